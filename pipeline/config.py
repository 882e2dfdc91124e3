"""The one typed config of a moonserve application.

`AppConfig` is the `args` block of a Ray Serve config file (`configs/*.yaml`); Ray Serve validates it
through the annotation on `deployments.builder.build_app`, and `moonserve serve` validates it the same
way. Every model forbids unknown keys, so a typo fails at start with a message that names the key.

Example:
    >>> cfg = load_app_config("configs/local.yaml")
    >>> cfg.language_model.engine.dtype
    'float32'
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    model_validator,
)

EMBEDDED_MODEL = "embedded"
# The embedded default, next to the package in a source checkout.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentOptions(StrictModel):
    """Ray Serve options of one deployment (the subset moonserve relies on)."""

    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt = 64
    num_cpus: float = Field(0.0, ge=0)
    health_check_period_s: PositiveFloat = 5.0
    health_check_timeout_s: PositiveFloat = 30.0
    graceful_shutdown_timeout_s: PositiveFloat = 20.0

    def serve_options(self) -> dict:
        return {
            "num_replicas": self.num_replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
        }


class EngineConfig(StrictModel):
    """vLLM engine arguments moonserve passes through, named and typed.

    `model: embedded` means the SmolLM2-135M-Instruct checkpoint built by `moonserve prepare`.
    """

    model: str = EMBEDDED_MODEL
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: PositiveInt | None = None
    tensor_parallel_size: PositiveInt = 1
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    kv_cache_memory_bytes: PositiveInt | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    trust_remote_code: bool = False

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == EMBEDDED_MODEL:
            return "moonserve-embedded"
        return self.model


class PlacementConfig(StrictModel):
    """The placement group each LanguageModel replica requests.

    Bundle 0 also holds the replica actor itself. With `tensor_parallel_size > 1` vLLM's Ray
    executor places one worker per bundle, so there must be one bundle per TP rank.
    Production: 8 x `{"GPU": 1}` with STRICT_PACK; embedded: one small CPU bundle.
    """

    bundles: list[dict[str, float]] = Field(default_factory=lambda: [{"CPU": 1.0}], min_length=1)
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"


class LanguageModelConfig(StrictModel):
    engine: EngineConfig = EngineConfig()
    placement: PlacementConfig = PlacementConfig()
    deployment: DeploymentOptions = DeploymentOptions()
    # Environment for the replica and its vLLM processes (e.g. VLLM_CPU_OMP_THREADS_BIND).
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bundles_cover_tensor_parallel(self) -> LanguageModelConfig:
        tp = self.engine.tensor_parallel_size
        if tp > 1 and len(self.placement.bundles) < tp:
            raise ValueError(
                f"placement.bundles has {len(self.placement.bundles)} bundle(s) but "
                f"engine.tensor_parallel_size is {tp}: give one bundle per TP rank"
            )
        return self


class AuthConfig(StrictModel):
    """API keys for `/v1/*` (`Authorization: Bearer <key>`); `/health` stays open.

    Keys come from `api_keys` and from the comma-separated environment variable `api_keys_env`
    (read where the app is built). Enabled with no key at all is a start-up error.
    """

    enabled: bool = True
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_env: str = "MOONSERVE_API_KEYS"


class LimitsConfig(StrictModel):
    """Per-request limits, enforced by the router before any engine work (400/413 naming them)."""

    max_request_bytes: PositiveInt = 1 << 20
    max_messages: PositiveInt = 256
    max_message_chars: PositiveInt = 1 << 18
    # Largest max_tokens a request may ask for (None: up to the context limit).
    max_tokens: PositiveInt | None = None
    # max_tokens when a request leaves it unset (None: up to the context limit, as OpenAI does).
    default_max_tokens: PositiveInt | None = None


class RouterConfig(StrictModel):
    deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=256)
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()


class AppConfig(StrictModel):
    """`args` of the moonserve application in a Ray Serve config file."""

    router: RouterConfig = RouterConfig()
    language_model: LanguageModelConfig = LanguageModelConfig()


def load_serve_config(path: str | Path) -> dict:
    """Read a Ray Serve config file; returns the parsed YAML."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data.get("applications"):
        raise ValueError(f"{path}: not a Ray Serve config file (no 'applications' list)")
    return data


def load_app_config(path: str | Path, app_name: str | None = None) -> AppConfig:
    """Validate the `args` of the moonserve application in a Ray Serve config file."""
    apps = load_serve_config(path)["applications"]
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{path}: no application named {app_name!r}")
    return AppConfig.model_validate(app.get("args") or {})
