"""The one typed config of a moonserve application.

`AppConfig` is the `args` block of a Ray Serve config file (`configs/*.yaml`); Ray Serve validates it
through the annotation on `moonserve.deployments.builder.build_app`, and `moonserve serve` validates it the same
way. Every model forbids unknown keys, so a typo fails at start with a message that names the key.

Example:
    >>> cfg = load_app_config("configs/local.yaml")
    >>> cfg.language_model.engine.dtype
    'float32'
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    create_model,
    field_validator,
    model_validator,
)

from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.sessions import SessionLimits
from moonserve.pipeline.speculative.suffix import SuffixSettings
from moonserve.pipeline.vision.preprocess_config import PreprocessConfig
from moonserve.pipeline.vision.remote_policy import RemotePolicy

EMBEDDED_MODEL = "embedded"
# The embedded default, next to the package in a source checkout.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingOptions(StrictModel):
    """Ray Serve autoscaling of one deployment (replaces `num_replicas` when set)."""

    min_replicas: int = Field(1, ge=0, description=(
        "Fewest replicas Serve's autoscaler keeps; the app's capacity checks count at least 1."))
    max_replicas: PositiveInt = Field(1, description=(
        "Most replicas Serve's autoscaler starts; the app's checks and lane limits count this "
        "many Router replicas."))
    target_ongoing_requests: PositiveFloat = Field(2.0, description=(
        "Ongoing requests per replica the autoscaler steers toward."))
    upscale_delay_s: float = Field(30.0, ge=0, description=(
        "How long the autoscaler must want more replicas before it adds one."))
    downscale_delay_s: float = Field(600.0, ge=0, description=(
        "How long the autoscaler must want fewer replicas before it removes one."))

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is over max_replicas "
                             f"({self.max_replicas})")
        return self


class DeploymentOptions(StrictModel):
    """Ray Serve options of one deployment (the subset moonserve relies on)."""

    num_replicas: PositiveInt = Field(1, description=(
        "A fixed number of replicas (Serve's `num_replicas`); set this or `autoscaling`, not "
        "both."))
    autoscaling: AutoscalingOptions | None = Field(None, description=(
        "Serve autoscaling between `min_replicas` and `max_replicas`, in place of "
        "`num_replicas`; null: a fixed number of replicas."))
    max_ongoing_requests: PositiveInt = Field(64, description=(
        "Requests Serve sends one replica at once; the config check wants the Router's to hold "
        "its lanes (in flight plus queued) and the LanguageModel's to exceed what they admit."))
    num_cpus: float = Field(0.0, ge=0, description=(
        "CPUs Ray reserves for each replica actor (`ray_actor_options.num_cpus`)."))
    resources: dict[str, PositiveFloat] = Field(default_factory=dict, description=(
        "Ray custom resources each replica takes, which pin it to the nodes started with them "
        "(`ray start --resources '{\"moonserve_head\": 1}'`); the LanguageModel's go in its "
        "placement bundles instead."))
    max_replicas_per_node: PositiveInt | None = Field(None, description=(
        "At most this many replicas on one node (Serve's `max_replicas_per_node`); 1 spreads "
        "them over the nodes, e.g. Router replicas that keep serving when a node is lost (their "
        "stored Responses turns then belong in Redis, `router.responses.database`). null: Serve "
        "places them. Not for the LanguageModel, which runs in a placement group."))
    health_check_period_s: PositiveFloat = Field(5.0, description=(
        "Seconds between Serve's health checks of a replica."))
    health_check_timeout_s: PositiveFloat = Field(30.0, description=(
        "Seconds a health check may take before Serve counts it failed (Serve replaces a "
        "replica whose checks fail)."))
    graceful_shutdown_timeout_s: PositiveFloat | None = Field(None, description=(
        "How long a replica being scaled down or replaced may finish its requests; null: the "
        "app's `drain` bound for the Router, LanguageModel and DraftService, Serve's 20 s for "
        "the others."))

    @model_validator(mode="after")
    def _one_way_to_size(self) -> DeploymentOptions:
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set num_replicas or autoscaling, not both")
        return self

    def max_replicas(self) -> int:
        return self.num_replicas if self.autoscaling is None else self.autoscaling.max_replicas

    def min_replicas(self) -> int:
        return self.num_replicas if self.autoscaling is None else \
            max(1, self.autoscaling.min_replicas)

    def serve_options(self, drain_s: float | None = None) -> dict:
        """Serve's deployment options; `drain_s` is the graceful shutdown unless this sets one."""
        replicas = {"num_replicas": self.num_replicas} if self.autoscaling is None else \
            {"autoscaling_config": self.autoscaling.model_dump()}
        graceful = self.graceful_shutdown_timeout_s or drain_s
        return {
            **replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            **({"graceful_shutdown_timeout_s": graceful} if graceful else {}),
            **({"max_replicas_per_node": self.max_replicas_per_node}
               if self.max_replicas_per_node is not None else {}),
        }


# Every engine's structured outputs (vLLM's `structured_outputs_config`; docs/tools.md).
# - backend: vLLM's `auto` picks a backend per request when it validates one, but its engine builds
#   a single backend from the first such request and compiles every later schema with it, so a
#   schema checked for one backend could be compiled by another. The Router holds schemas to what
#   xgrammar enforces (pipeline/router/json_schemas.py); xgrammar also compiles tool-call tags.
# - disable_any_whitespace: with free whitespace between JSON tokens a model can spend max_tokens on
#   newlines inside a constrained answer (`moonserve bench structured`, docs/benchmarks.md).
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


class EngineConfig(StrictModel):
    """vLLM engine arguments moonserve passes through, named and typed.

    `model: embedded` means the SmolLM2-135M-Instruct checkpoint built by `moonserve prepare`.
    """

    model: str = Field(EMBEDDED_MODEL, description=(
        "The checkpoint vLLM serves and the Router tokenizes with: a path or model id, as is; "
        "`embedded` is the SmolLM2-135M-Instruct checkpoint `moonserve prepare` builds."))
    served_model_name: str | None = Field(None, description=(
        "The name `/v1/models` lists and requests must give as `model` (another name is a 404); "
        "null: `model`, or `moonserve-embedded` for the embedded model."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "vLLM's `dtype` (also the encoder engine's with `vision.handover: encoder_cache`); "
        "`auto`: the checkpoint's."))
    max_model_len: PositiveInt | None = Field(None, description=(
        "vLLM's context length, prompt plus completion, which the Router checks requests "
        "against; null: the checkpoint's."))
    tensor_parallel_size: PositiveInt = Field(1, description=(
        "Tensor-parallel ranks of one LanguageModel replica (one placement bundle each); over 1 "
        "vLLM runs its Ray executor on GPUs, its multiprocessing workers on CPU."))
    decode_context_parallel_size: PositiveInt = Field(1, description=(
        "Decode context parallelism: the KV cache of one long request spread over this many TP "
        "ranks (must divide tensor_parallel_size); what lets one 1M-token request fit a node."))
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field("auto", description=(
        "vLLM's KV cache dtype: `fp8` halves the KV cache (production); `auto` keeps the model "
        "dtype."))
    max_num_seqs: PositiveInt = Field(64, description=(
        "vLLM's `max_num_seqs`: the most requests (sequences) the engine runs in one step."))
    max_num_batched_tokens: PositiveInt | None = Field(None, description=(
        "vLLM's token budget of one engine step, prefill and decode together; null: vLLM's "
        "default."))
    enable_prefix_caching: bool = Field(True, description=(
        "vLLM's automatic prefix caching: prompts that share a prefix reuse its KV cache."))
    enforce_eager: bool = Field(False, description=(
        "vLLM's `enforce_eager`: no compiled graphs (also for the encoder engine); "
        "`draft.drafter: dspark_context` needs it on vLLM's model runner V1 (the CPU build), "
        "whose forward hooks skip compiled graphs; on V2 (GPUs) the target returns the hidden "
        "states itself."))
    scheduling_policy: Literal["fcfs", "priority"] = Field("priority", description=(
        "vLLM's scheduling policy: `priority` runs lower `priority` first (the router's lanes "
        "set it), `fcfs` arrival order; both shipped configs use `priority`."))
    # Under the LaneScheduler the cap applies only where it protects someone: prefills that share
    # a step, or a prefill beside better-priority decodes.
    long_prefill_token_threshold: int = Field(0, ge=0, description=(
        "Chunked prefill: at most this many prompt tokens of one request per engine step when "
        "other requests are present (0: no cap), so a long prefill cannot hold interactive "
        "decode back."))
    # The LaneScheduler extends vLLM's synchronous scheduler, so it turns vLLM's async scheduling
    # off (CPU engines never have it; GPU engines do, so production keeps false).
    strict_prefill_priority: bool = Field(False, description=(
        "With `priority`, true runs pipeline/engine/lane_scheduler.py's LaneScheduler: while a "
        "request of the best priority present waits or prefills, worse-priority prefill chunks "
        "sit the step out (their decodes still run); configs/local.yaml: true, "
        "configs/mi355x-k3.1-pro.yaml: false."))
    # vLLM gives a lone prefill the whole step budget; a background one stays small, so the step a
    # new chat request arrives during is short.
    background_priority: int | None = Field(None, description=(
        "Requests of this priority or worse (the long-context lane's) are background: their "
        "prefill takes at most `background_prefill_chunk_tokens` per step, alone too; null: no "
        "background requests (needs strict_prefill_priority)."))
    background_prefill_chunk_tokens: PositiveInt = Field(32, description=(
        "The most prompt tokens a background request prefills in one engine step."))
    seed: int = Field(0, description="vLLM's random seed (also the encoder engine's).")
    kv_cache_memory_bytes: PositiveInt | None = Field(None, description=(
        "vLLM's `kv_cache_memory_bytes`: the KV cache's size, instead of what "
        "`gpu_memory_utilization` leaves; null: vLLM sizes it."))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description=(
        "vLLM's share of each GPU's memory for the engine (weights, activations, KV cache)."))
    trust_remote_code: bool = Field(False, description=(
        "Run code shipped with the checkpoint: in vLLM, the encoder engine and the Router's "
        "tokenizer (Kimi checkpoints ship their tokenizer as code)."))
    enable_prompt_embeds: bool = Field(False, description=(
        "Multimodal requests reach vLLM as prompt embeddings (needed with `vision.handover: "
        "prompt_embeds`); text requests stay token ids."))
    worker_extension_cls: str | None = Field(None, description=(
        "vLLM's `worker_extension_cls`: a class mixed into every engine worker, whose methods "
        "`LanguageModel.collective_rpc` calls (debugging and test probes); null: none."))
    mm_encoder_tp_mode: Literal["weights", "data"] | None = Field(None, description=(
        "vLLM's `mm_encoder_tp_mode` for an in-engine vision tower (also the encoder engine's): "
        "`data` runs it replicated per rank (K3's ViT heads do not divide TP 8); null: vLLM's "
        "default."))
    cudagraph_mode: Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
                            "FULL_AND_PIECEWISE"] | None = Field(None, description=(
        "vLLM's `compilation_config.cudagraph_mode` (production: FULL_DECODE_ONLY); null: "
        "vLLM's default."))
    custom_ops: tuple[str, ...] = Field((), description=(
        "vLLM's `compilation_config.custom_ops` (production: `+fused_rms_norm_gated`); empty: "
        "vLLM's default."))

    @model_validator(mode="after")
    def _background_needs_lane_scheduler(self) -> EngineConfig:
        if self.background_priority is not None and self.scheduler_cls() is None:
            raise ValueError("background_priority needs scheduling_policy: priority and "
                             "strict_prefill_priority: true (pipeline/engine/lane_scheduler.py)")
        return self

    def scheduler_cls(self) -> str | None:
        """vLLM's `scheduler_cls` for this engine (None: vLLM's own)."""
        if self.scheduling_policy == "priority" and self.strict_prefill_priority:
            return "moonserve.pipeline.engine.lane_scheduler.LaneScheduler"
        return None

    def scheduler_options(self) -> dict:
        """What `LaneScheduler` reads from vLLM's `additional_config`."""
        return {"moonserve_lanes": {
            "background_priority": self.background_priority,
            "background_prefill_chunk_tokens": self.background_prefill_chunk_tokens}}

    def compilation_config(self) -> dict:
        """vLLM's `compilation_config` overrides ({}: vLLM's defaults)."""
        config = {"cudagraph_mode": self.cudagraph_mode} if self.cudagraph_mode else {}
        return config | ({"custom_ops": list(self.custom_ops)} if self.custom_ops else {})

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

    bundles: list[dict[str, float]] = Field(
        default_factory=lambda: [{"CPU": 1.0}], min_length=1, description=(
            "Ray resources of each bundle; bundle 0 also holds the replica actor, and with "
            "tensor_parallel_size over 1 there is one bundle per TP rank."))
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description=(
            "Ray's placement strategy for the bundles; `STRICT_PACK` keeps them on one node."))


class ToolsConfig(StrictModel):
    """Tool calling (docs/tools.md)."""

    parser: str | None = Field(None, description=(
        "vLLM's tool parser for the model's call format (vllm/tool_parsers): `hermes` for the "
        "embedded model's template, `kimi_k3` for Kimi K3.1; null: requests with tools get a "
        "400."))
    strict_level: Literal["auto", "function", "parameter"] = Field("parameter", description=(
        "vLLM's --tool-strict-level: `parameter` holds every call's arguments to its tool's "
        "schema in every tool_choice mode, `function` only the call envelope, `auto` as vLLM's "
        "server by default (arguments only for `strict: true` tools)."))


class ReasoningConfig(StrictModel):
    parser: str | None = Field(None, description=(
        "vLLM's reasoning parser (vllm/reasoning), e.g. `kimi_k3`: thinking goes to "
        "`reasoning_content`, and structured outputs apply after it; null: no reasoning split."))


class ChatConfig(StrictModel):
    """How chat requests are rendered and their outputs parsed, per served model."""

    template: str | None = Field(None, description=(
        "A chat template replacing the checkpoint's: one shipped with moonserve by name "
        "(`pipeline/models/templates/<name>.jinja`) or a path to a .jinja file; null: the "
        "checkpoint's."))
    tools: ToolsConfig = Field(ToolsConfig(), description="Tool calling (docs/tools.md).")
    reasoning: ReasoningConfig = Field(ReasoningConfig(), description=(
        "Splitting the model's thinking from its answer; the engine gets the parser too."))


class RoutingConfig(StrictModel):
    """How callers pick a LanguageModel replica (matters with more than one).

    `prefix_affinity` (pipeline/router/prefix_affinity.py, Serve's request-router API): the least
    loaded of the replicas that were sent the longest prefix of the prompt (token-id blocks of
    `block_tokens`, images by content hash), else the one the request's `prompt_cache_key` (or
    `user`) hashes to, while its queue is at most `imbalance_threshold` longer than the lightest
    replica's; else power of two choices. `power_of_two`: Serve's default router.
    """

    policy: Literal["prefix_affinity", "power_of_two"] = Field("prefix_affinity", description=(
        "`prefix_affinity`: pipeline/router/prefix_affinity.py's request router; "
        "`power_of_two`: Serve's default (both shipped configs leave `prefix_affinity`, with "
        "one LanguageModel replica each)."))
    block_tokens: PositiveInt = Field(64, description=(
        "Token ids per prefix key: prompts are matched in whole blocks of this many."))
    imbalance_threshold: int = Field(4, ge=0, description=(
        "How many requests longer than the lightest replica's queue the affine replica's may be "
        "and still get the request."))
    max_keys: PositiveInt = Field(100_000, description=(
        "Prefix keys remembered per caller (each Router replica; ~200 bytes each), least "
        "recently used dropped: 100,000 keys of 64 tokens cover 6.4M tokens of distinct "
        "prefixes."))

    def request_router_config(self) -> dict | None:
        """Serve's `request_router_config` for the LanguageModel deployment (None: Serve's)."""
        if self.policy == "power_of_two":
            return None
        return {"request_router_class":
                "moonserve.pipeline.router.prefix_affinity.PrefixAffinityRouter",
                "request_router_kwargs": {"block_tokens": self.block_tokens,
                                          "imbalance_threshold": self.imbalance_threshold,
                                          "max_keys": self.max_keys}}


class LanguageModelConfig(StrictModel):
    platform: Literal["any", "cpu", "cuda", "rocm"] = Field("any", description=(
        "The accelerator platform this config is written for. A LanguageModel replica whose "
        "vLLM runs on another (vLLM's `current_platform`) refuses to start, naming both: the "
        "MI355X config's engine settings (AITER, TRITON_MLA, the ROCm env) mean nothing "
        "elsewhere, and PyPI's CUDA vLLM on a ROCm node would run none of them."))
    engine: EngineConfig = Field(EngineConfig(), description=(
        "vLLM engine arguments moonserve passes through, named and typed."))
    chat: ChatConfig = Field(ChatConfig(), description=(
        "How chat requests are rendered and their outputs parsed (the Router does both)."))
    placement: PlacementConfig = Field(PlacementConfig(), description=(
        "The placement group each LanguageModel replica requests (production: 8 x "
        "`{GPU: 0.95}` with STRICT_PACK; embedded: one `{CPU: 1}` bundle)."))
    deployment: DeploymentOptions = Field(DeploymentOptions(), description=(
        "Serve options of the LanguageModel deployment (its custom resources go in "
        "`placement.bundles[0]`)."))
    routing: RoutingConfig = Field(RoutingConfig(), description=(
        "How callers pick a LanguageModel replica (matters with more than one)."))
    env: dict[str, str] = Field(default_factory=dict, description=(
        "Environment for the replica and its vLLM processes (Ray runtime_env; e.g. "
        "VLLM_CPU_OMP_THREADS_BIND)."))

    @model_validator(mode="after")
    def _bundles_cover_tensor_parallel(self) -> LanguageModelConfig:
        tp = self.engine.tensor_parallel_size
        if tp % self.engine.decode_context_parallel_size:
            raise ValueError(f"engine.decode_context_parallel_size "
                             f"({self.engine.decode_context_parallel_size}) must divide "
                             f"engine.tensor_parallel_size ({tp})")
        if tp > 1 and len(self.placement.bundles) < tp:
            raise ValueError(
                f"placement.bundles has {len(self.placement.bundles)} bundle(s) but "
                f"engine.tensor_parallel_size is {tp}: give one bundle per TP rank"
            )
        if self.deployment.resources:
            raise ValueError("deployment.resources: the LanguageModel replica runs in its "
                             "placement group; put custom resources in placement.bundles[0]")
        if self.deployment.max_replicas_per_node is not None:
            raise ValueError("deployment.max_replicas_per_node: the LanguageModel replica runs "
                             "in its placement group, which Serve does not combine with it; "
                             "pin replicas to nodes with custom resources in placement.bundles")
        return self


class AuthConfig(StrictModel):
    """API keys for `/v1/*` (`Authorization: Bearer <key>`); `/health` stays open.

    Keys come from `api_keys` and from the comma-separated environment variable `api_keys_env`
    (read where the app is built). Enabled with no key at all is a start-up error.
    """

    enabled: bool = Field(True, description=(
        "Check API keys on `/v1/*` (a 401 without a valid one); configs/local.yaml turns it off "
        "(it listens on 127.0.0.1), configs/mi355x-k3.1-pro.yaml keeps it on."))
    api_keys: list[SecretStr] = Field(default_factory=list, description=(
        "API keys written in the config; the Router keeps only their digests."))
    api_keys_env: str = Field("MOONSERVE_API_KEYS", description=(
        "The environment variable holding more keys, comma-separated, read on the node that "
        "builds the app."))


class LimitsConfig(StrictModel):
    """Per-request limits, enforced by the router before any engine work (400/413 naming them)."""

    max_request_bytes: PositiveInt = Field(1 << 20, description=(
        "Largest request body, read no further than this (413); images sent as data URLs count "
        "(base64: 4/3 of the image bytes)."))
    max_messages: PositiveInt = Field(256, description="Messages in one chat request (400).")
    max_message_chars: PositiveInt = Field(1 << 18, description=(
        "Characters of text in one message, or in a completions `prompt` string (400)."))
    max_tokens: PositiveInt | None = Field(None, description=(
        "Largest max_tokens (or max_completion_tokens) a request may ask for; null: up to the "
        "context limit."))
    default_max_tokens: PositiveInt | None = Field(None, description=(
        "max_tokens when a request leaves it unset; null: up to the context limit, as OpenAI "
        "does."))
    max_images: int = Field(8, ge=0, description=(
        "Image parts in one request (each is preprocessed and encoded); with `vision.handover: "
        "encoder_cache` also vLLM's `limit_mm_per_prompt`."))
    max_choices: PositiveInt = Field(16, description=(
        "Choices (`n`) in one request: they share the request's lane slot but each is an engine "
        "sequence, so this bounds what one admitted request can put into the engine."))

    @model_validator(mode="after")
    def _default_within_cap(self) -> LimitsConfig:
        if None not in (self.max_tokens, self.default_max_tokens) and \
                self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) is over max_tokens "
                             f"({self.max_tokens})")
        return self


class RateLimitsConfig(StrictModel):
    """Per client (API key; client address with auth off), for the whole application whatever the
    number of Router replicas (pipeline/api/token_buckets.py). Over a limit: 429 with Retry-After.

    With a limit set, the app runs a `RateLimiter` deployment that holds every client's buckets;
    each request costs the Router one call to it before the body is read, and one when it ends.
    If that call fails, the request goes ahead (a limiter restart must not stop the service).
    """

    requests_per_s: PositiveFloat | None = Field(None, description=(
        "Requests each client may send per second (a second's worth at once); null: no limit."))
    tokens_per_min: PositiveInt | None = Field(None, description=(
        "Prompt plus completion tokens per client per minute, charged when a request ends; "
        "null: no limit."))

    def enabled(self) -> bool:
        return self.requests_per_s is not None or self.tokens_per_min is not None


class LaneLimits(StrictModel):
    """One lane's admission limits toward the LanguageModel (for the application, or per Router
    replica: `LanesConfig.scope`)."""

    max_in_flight: PositiveInt = Field(description=(
        "Requests of this lane generating at once; the rest wait in the lane's queue."))
    max_queue: int = Field(ge=0, description=(
        "Requests waiting for a slot; one more is rejected at once (429/503 + Retry-After)."))
    queue_timeout_s: PositiveFloat = Field(60.0, description=(
        "A request still queued after this long is answered with 503 + Retry-After."))
    priority: int = Field(0, description=(
        "vLLM request priority (lower is scheduled first; needs engine.scheduling_policy: "
        "priority)."))

    def refuses(self, in_flight: int, queued: int) -> bool:
        """A request arriving at a lane with these counts is refused at once."""
        return in_flight >= self.max_in_flight and queued >= self.max_queue


class LanesConfig(StrictModel):
    """Admission at the Router: `interactive` and `long_context` lanes, or one FIFO lane.

    A request whose prompt (image tokens included) has at least `long_context_threshold_tokens`
    tokens goes to `long_context`, any other to `interactive`. The header `hint_header` may move a
    short request to `long_context` (a batch job that should not compete with chat); asking for
    `interactive` with a long prompt is a 400. With `enabled: false` every request goes through
    the single `fifo` lane in arrival order (the benchmark's baseline).

    `scope: application` holds each lane's limits for the whole application: with more than one
    Router replica (`router.deployment`), they admit through one `LaneAdmission` replica
    (pipeline/api/application_lanes.py), one call per request; with one, its own lanes are the
    application's. `scope: replica` gives every Router replica the limits for itself.
    """

    enabled: bool = Field(True, description=(
        "true: the `interactive` and `long_context` lanes (both shipped configs); false: every "
        "request through the single `fifo` lane in arrival order (the benchmark's baseline)."))
    scope: Literal["application", "replica"] = Field("application", description=(
        "`application`: each lane's limits hold for the whole app (several Router replicas "
        "admit through one LaneAdmission replica); `replica`: each Router replica has them for "
        "itself (both shipped configs: `application`)."))
    long_context_threshold_tokens: PositiveInt = Field(2048, description=(
        "Prompts of at least this many tokens, image tokens included, go to `long_context`."))
    hint_header: str = Field("x-moonserve-lane", description=(
        "The request header that may move a short request to `long_context` (asking for "
        "`interactive` with a long prompt is a 400)."))
    reject_status: Literal[429, 503] = Field(429, description=(
        "Status of a rejection when a lane's queue is full: 429 (client backs off) or 503."))
    retry_after_s: PositiveInt = Field(1, description=(
        "The Retry-After header, in seconds, of a lane's rejections and queue timeouts."))
    interactive: LaneLimits = Field(
        LaneLimits(max_in_flight=48, max_queue=128, queue_timeout_s=30.0, priority=0),
        description="The lane of prompts under `long_context_threshold_tokens`.")
    long_context: LaneLimits = Field(
        LaneLimits(max_in_flight=8, max_queue=32, queue_timeout_s=300.0, priority=10),
        description="The lane of long prompts and of requests the hint header sends there.")
    fifo: LaneLimits = Field(
        LaneLimits(max_in_flight=56, max_queue=160, queue_timeout_s=300.0),
        description="The one lane of every request when `enabled` is false.")

    def active(self) -> dict[str, LaneLimits]:
        """The lanes requests are admitted through, by name."""
        if not self.enabled:
            return {"fifo": self.fifo}
        return {"interactive": self.interactive, "long_context": self.long_context}

    def capacity(self) -> int:
        """Requests one Router replica holds at most (in flight plus queued)."""
        return sum(lane.max_in_flight + lane.max_queue for lane in self.active().values())

    def max_in_flight(self) -> int:
        return sum(lane.max_in_flight for lane in self.active().values())

    def copies(self, router_replicas: int) -> int:
        """How many times over the limits admit with this many Router replicas."""
        return 1 if self.scope == "application" else router_replicas


def preprocess_fields() -> dict[str, tuple]:
    """`PreprocessConfig`'s fields as pydantic ones: the type with its bound, the default and the
    description, each written once (pipeline/vision/preprocess_config.py)."""
    types = get_type_hints(PreprocessConfig, include_extras=True)
    return {f.name: (types[f.name], Field(f.default, description=f.metadata["description"]))
            for f in fields(PreprocessConfig)}


# The YAML keys `patch_size` to `background_rgb` of `vision.preprocessor`.
PreprocessFields = create_model("PreprocessFields", __base__=StrictModel, __module__=__name__,
                                **preprocess_fields())


class ImagePreprocessorConfig(PreprocessFields):
    """ImagePreprocessor deployment: fetch, decode, validate, NaViT resize, normalize, patchify.

    The fields from `patch_size` to `background_rgb` are `PreprocessConfig`'s
    (pipeline/vision/preprocess_config.py: types, bounds, defaults and descriptions); the layout
    fields mirror the checkpoint's `preprocessor_config.json` (`media_proc_cfg`). `remote` is a
    `RemotePolicy` (pipeline/vision/remote_policy.py): `http(s)` image URLs are off unless
    `allowed_hosts` names hosts.
    """

    remote: RemotePolicy = Field(RemotePolicy(), description=(
        "Which `http(s)` image URLs may be fetched (pipeline/vision/remote_policy.py); off "
        "unless `allowed_hosts` names hosts."))
    max_batch_size: PositiveInt = Field(8, description=(
        "Images decoded together per replica (serve.batch); a batch runs in one worker "
        "thread."))
    batch_wait_timeout_s: float = Field(0.002, ge=0, description=(
        "How long a batch waits for more images before it runs (serve.batch)."))
    deployment: DeploymentOptions = Field(DeploymentOptions(max_ongoing_requests=32),
                                          description="Serve options of the ImagePreprocessor.")

    @model_validator(mode="after")
    def _preprocessing_is_valid(self) -> ImagePreprocessorConfig:
        self.preprocess_config()  # its own checks (square merge kernel, std > 0, ...) at load
        return self

    def preprocess_config(self) -> PreprocessConfig:
        """The fields named like `PreprocessConfig`'s, as the dataclass the replica runs with."""
        return PreprocessConfig(**{f.name: getattr(self, f.name) for f in fields(PreprocessConfig)})


class VisionEncoderConfig(StrictModel):
    """VisionEncoder deployment: MoonViT-V2 over packed batches, with an embedding cache.

    `model: embedded` is a small seeded random MoonViT built by `moonserve prepare` (it projects
    to the embedded LM's hidden size; its weights are random, so the embedded model cannot see).
    """

    model: str = Field(EMBEDDED_MODEL, description=(
        "handover prompt_embeds: the MoonViT checkpoint; `embedded`: the seeded random one "
        "`moonserve prepare` builds (encoder_cache runs the LM checkpoint's own tower)."))
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "handover prompt_embeds: the dtype MoonViT runs in (encoder_cache: the LM engine's)."))
    attention_backend: Literal["auto", "sdpa", "triton", "naive"] = Field("auto", description=(
        "handover prompt_embeds: MoonViT's varlen attention kernel; `auto` picks one (neither "
        "shipped config sets it)."))
    max_batch_size: PositiveInt = Field(8, description=(
        "Images packed into one forward pass (serve.batch across concurrent requests); with "
        "encoder_cache the encoder engine's max_num_seqs."))
    batch_wait_timeout_s: float = Field(0.005, ge=0, description=(
        "handover prompt_embeds: how long a batch waits for more images before it runs."))
    cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description=(
        "handover prompt_embeds: encoder outputs kept per replica, keyed by the SHA-256 of the "
        "image bytes (LRU by bytes)."))
    num_gpus: float = Field(0.0, ge=0, description=(
        "GPUs Ray reserves for each replica (a fraction shares one; production: 0.05); 0: "
        "none."))
    store: str = Field("/dev/shm/moonserve-ec", description=(
        "handover encoder_cache: the node-local store the encoder engine writes and the "
        "LanguageModel's engine reads (pipeline/engine/ec_connector.py)."))
    store_max_bytes: PositiveInt | None = Field(4 * 1024**3, description=(
        "handover encoder_cache: the bytes the store may hold, least recently used entries "
        "going first; null: no bound."))
    # The encoder engine holds the tower's weights and activations, no KV cache.
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description=(
        "handover encoder_cache: the encoder engine's vLLM `gpu_memory_utilization` (on CPU, the "
        "fraction of RAM it must find free at start)."))
    deployment: DeploymentOptions = Field(DeploymentOptions(max_ongoing_requests=32),
                                          description="Serve options of the VisionEncoder.")


class VisionConfig(StrictModel):
    """Images in chat messages: Router -> ImagePreprocessor -> VisionEncoder -> LanguageModel.

    `handover`: how the encoder's outputs reach the language model.
    - `prompt_embeds` (text-only LMs, the embedded SmolLM2): the VisionEncoder runs MoonViT
      (`vision.encoder.model`) and the LanguageModel splices its rows into the prompt's
      embeddings, sent to vLLM as `prompt_embeds` (needs `engine.enable_prompt_embeds`).
    - `encoder_cache` (LMs vLLM serves as multimodal: Kimi K2.5, K3): the VisionEncoder runs the
      LM checkpoint's own vision tower in an encoder-only vLLM engine (`ec_producer`), which writes
      each image's output to `encoder.store` under the image's SHA-256; the LanguageModel sends
      vLLM the image in the model's own prompt format with that key as its `multi_modal_uuids`,
      and its engine (`ec_consumer`) loads the stored output instead of running the tower.

    `image_placeholder` is the token the router expands to one position per image token, so
    lengths, lanes and usage count image tokens: with `prompt_embeds` the prompt carries it once
    per image (embedded SmolLM2: its unused special token `<empty_output>`) and the LM overwrites
    the run with the encoder's rows; with `encoder_cache` it is the token vLLM's processor expands
    inside the model's placeholder text (`get_placeholder_str`; Kimi K2.5: `<|media_pad|>`; Kimi
    K3: `<|kimi_image_placeholder|>`, counted with the sized wrapper vLLM writes around the pads),
    and the LM hands vLLM the prompt unexpanded.
    """

    handover: Literal["prompt_embeds", "encoder_cache"] = Field("prompt_embeds", description=(
        "How the encoder's outputs reach the language model: `prompt_embeds` (text-only LMs; "
        "configs/local.yaml) or `encoder_cache` (LMs vLLM serves as multimodal; "
        "configs/mi355x-k3.1-pro.yaml)."))
    image_placeholder: str = Field("<empty_output>", description=(
        "The token the Router expands to one position per image token (embedded SmolLM2: "
        "`<empty_output>`; Kimi K3: `<|kimi_image_placeholder|>`)."))
    preprocessor: ImagePreprocessorConfig = Field(ImagePreprocessorConfig(), description=(
        "The ImagePreprocessor deployment: fetch, decode, validate, resize, patchify."))
    encoder: VisionEncoderConfig = Field(VisionEncoderConfig(), description=(
        "The VisionEncoder deployment: image patches to the LM's embeddings."))


K3_DSPARK = ("K3DSparkModel", "k3_dspark")  # config.json architectures[0], model_type


def architecture_of(config: dict) -> str | None:
    """A checkpoint config.json's first `architectures` entry (None without one)."""
    return (config.get("architectures") or [None])[0]


def is_k3_dspark(config: dict) -> bool:
    """Whether vLLM runs this draft config.json as K3's MLA drafter (vllm/config/speculative.py:
    it turns a DSparkDraftModel of model_type qwen3, or a speculators-format draft (vLLM's K3
    recipe's), into a dense `Qwen3DSparkModel`, and any other draft into DeepSeek-V4's `DSparkDraftModel`)."""
    return architecture_of(config) == K3_DSPARK[0] or config.get("model_type") == K3_DSPARK[1]


def dspark_draft_kind(config: dict) -> str | None:
    """What vLLM runs a DSpark draft's config.json as; None for a checkpoint that is not one."""
    architecture = architecture_of(config)
    if is_k3_dspark(config):
        return "K3DSparkModel: K3's MLA drafter (draft.attention_backend TRITON_MLA holds)"
    if config.get("speculators_model_type") == "dspark":
        return ("Qwen3DSparkModel (speculators format): dense, non-MLA (not for "
                "draft.attention_backend TRITON_MLA)")
    if architecture == "Qwen3DSparkModel" or (architecture == "DSparkDraftModel"
                                              and config.get("model_type") == "qwen3"):
        return "Qwen3DSparkModel: dense, non-MLA (not for draft.attention_backend TRITON_MLA)"
    if architecture and "DSpark" in architecture:
        return f"{architecture}: not a K3 draft (not for draft.attention_backend TRITON_MLA)"
    return None


def check_k3_dspark_draft(model: str, setting: str) -> None:
    """`setting` (an MLA backend for the draft) holds only for a K3 DSpark draft. Reads `model`'s
    config.json where it is on this machine (the LanguageModel replica, on the node that holds
    the draft, checks again)."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return
    import json

    config = json.loads(config_file.read_text())
    if not is_k3_dspark(config):
        architecture = architecture_of(config)
        raise ValueError(
            f"draft.model: {model} is a {architecture} draft (model_type "
            f"{config.get('model_type')}), not a {K3_DSPARK[0]} ({K3_DSPARK[1]}); vLLM runs it "
            f"as {dspark_draft_kind(config) or architecture}, which {setting} is not for: use a "
            f"K3 DSpark checkpoint, or unset {setting}")


class DraftConfig(StrictModel):
    """Speculative decoding: where the draft tokens come from; vLLM verifies them losslessly.

    - `service`: the DraftService deployment drafts (`drafter`), called every engine step by the
      LM's proposer (`moonserve.pipeline.engine.proposer`) over a direct connection. A call that misses
      `deadline_ms` yields no drafts for that step; the service down = no speculation.
      Drafters: `ngram` (prompt lookup), `dspark` (the DSpark model over tokens only; `embedded`
      by default), `dspark_context` (a K3 DSpark checkpoint at `model`, drafting from the
      target's hidden states at its `target_layer_ids`, which the proposer sends with each step;
      on vLLM's model runner V1, the CPU build's, it needs `language_model.engine.enforce_eager`:
      the proposer reads them with forward hooks; on V2, GPUs, the target returns them).
    - `inline`: vLLM's own in-engine method: `dspark` (the separate DSpark draft checkpoint named by
      `model`, a `K3DSparkModel`; GPU only, production) or `ngram` (prompt lookup in the engine;
      the benchmark's baseline).
    - `off`: no speculation.
    """

    mode: Literal["service", "inline", "off"] = Field("off", description=(
        "Where draft tokens come from: `service` (the DraftService; configs/local.yaml), "
        "`inline` (vLLM's in-engine method; configs/mi355x-k3.1-pro.yaml) or `off`."))
    drafter: Literal["ngram", "suffix", "dspark", "dspark_context"] = Field("ngram", description=(
        "What drafts: `ngram` prompt lookup, `suffix` (suffix trees over the request and recent "
        "responses; service only; configs/local.yaml), the `dspark` model "
        "(configs/mi355x-k3.1-pro.yaml, inline) or `dspark_context` (service only)."))
    num_speculative_tokens: PositiveInt = Field(4, description=(
        "Draft tokens per request per engine step (with `adaptive`, the most)."))
    ngram_min: PositiveInt = Field(2, description=(
        "Smallest prompt lookup n-gram (vLLM's prompt_lookup_min), for both ngram drafters."))
    ngram_max: PositiveInt = Field(5, description=(
        "Largest prompt lookup n-gram (vLLM's prompt_lookup_max), for both ngram drafters."))
    suffix: SuffixSettings = Field(SuffixSettings(), description=(
        "With drafter `suffix`: its trees and thresholds (pipeline/speculative/suffix.py; vLLM's "
        "suffix_decoding_* settings)."))
    # Without it vLLM would read the draft from the target checkpoint and, for K3, resolve it as
    # DeepSeek-V4's `DSparkDraftModel`.
    model: str = Field(EMBEDDED_MODEL, description=(
        "DSpark drafter weights (`embedded`: built by `moonserve prepare` from the embedded "
        "target); with `inline`, vLLM's `speculative_config.model`."))
    attention_backend: str | None = Field(None, description=(
        "Inline dspark only: the draft's attention backend, a vLLM AttentionBackendEnum name "
        "such as TRITON_MLA; null: vLLM picks. Only for a K3 DSpark draft (`K3DSparkModel`): "
        "config load and the LanguageModel read `model`'s config.json and refuse another."))
    draft_sample_method: Literal["greedy", "probabilistic"] = Field("greedy", description=(
        "Inline dspark only: how the draft samples (vLLM's speculative_config)."))
    rejection_sample_method: Literal["standard", "block"] = Field("standard", description=(
        "Inline dspark only: how vLLM verifies a drafted block (vLLM's speculative_config)."))
    deadline_ms: PositiveFloat = Field(25.0, description=(
        "With `service`: the budget of one draft call as the engine step sees it; past it the "
        "step drafts nothing."))
    prefetch: bool = Field(True, description=(
        "With `service`: after answering step t, draft step t+1 assuming all of step t's drafts "
        "are accepted."))
    service_timeout_s: PositiveFloat = Field(2.0, description=(
        "With `service`: the LM replica's timeout on asking Serve where the DraftService is; "
        "meanwhile no drafts."))
    sessions: SessionLimits = Field(SessionLimits(), description=(
        "With `service`: bounds on the per-request contexts the DraftService holds "
        "(pipeline/speculative/sessions.py); the least recently used session goes first."))
    adaptive: AdaptivePolicy = Field(AdaptivePolicy(), description=(
        "With `service`: per request, draft only the tokens its acceptance so far makes worth it "
        "(num_speculative_tokens is then the most; pipeline/speculative/adaptive.py)."))
    num_gpus: float = Field(0.0, ge=0, description=(
        "With `service`: GPUs Ray reserves for each DraftService replica (its drafter runs on "
        "CUDA when set); below 1, a share of one GPU, beside an LM rank when the LM's bundles "
        "leave it, and the drafter's memory cap (`moonserve plan` counts it); 0: CPU."))
    deployment: DeploymentOptions = Field(DeploymentOptions(max_ongoing_requests=64), description=(
        "With `service`: Serve options of the DraftService; requests are sharded over "
        "`num_replicas` by request id (no autoscaling)."))

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML 1.1 reads a bare `off` as false: `draft: {mode: off}` means "off".
        return "off" if value is False else value

    @model_validator(mode="after")
    def _coherent(self) -> DraftConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"draft.ngram_min ({self.ngram_min}) is over draft.ngram_max "
                             f"({self.ngram_max})")
        if self.drafter == "suffix" and self.mode == "inline":
            raise ValueError("draft.drafter suffix is a DraftService drafter: set draft.mode to "
                             "service (vLLM's in-engine suffix method needs Arctic Inference, "
                             "which moonserve does not install)")
        if self.drafter == "dspark_context" and self.mode == "inline":
            raise ValueError("draft.drafter dspark_context is a DraftService drafter: set "
                             "draft.mode to service (inline, vLLM's own dspark reads the hidden "
                             "states in the engine)")
        if self.drafter == "dspark_context" and self.model == EMBEDDED_MODEL:
            raise ValueError("draft.model: drafter dspark_context needs a K3 DSpark checkpoint "
                             "(context_proj over the target's hidden states); the embedded "
                             "drafter reads tokens only")
        if self.mode == "inline" and self.drafter == "dspark" and self.attention_backend:
            check_k3_dspark_draft(self.model, "draft.attention_backend")
        if self.mode == "service" and self.deployment.autoscaling is not None:
            raise ValueError("draft.deployment.autoscaling: each request's context lives in the "
                             "replica its id is sharded to, over a fixed number of shards; set "
                             "num_replicas")
        return self

    def shards(self) -> int:
        """How many DraftService replicas the proposers shard requests over (by request id)."""
        return self.deployment.num_replicas

    def request_router_config(self) -> dict | None:
        """Serve's `request_router_config` for the DraftService: with several replicas, a call
        naming a shard goes to that shard's replica (pipeline/speculative/shards.py)."""
        if self.shards() == 1:
            return None
        return {"request_router_class": "moonserve.pipeline.router.draft_shards.ShardRouter"}

    def speculative_config(self) -> dict | None:
        """vLLM's `speculative_config` for this mode (None: off)."""
        k = self.num_speculative_tokens
        if self.mode == "off":
            return None
        if self.mode == "service":
            return {"method": "custom_class", "num_speculative_tokens": k,
                    "model": "moonserve.pipeline.engine.proposer.ServiceProposer"}
        if self.drafter == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k,
                    "prompt_lookup_min": self.ngram_min, "prompt_lookup_max": self.ngram_max}
        backend = {"attention_backend": self.attention_backend} if self.attention_backend else {}
        return {"method": "dspark", "model": self.model, "num_speculative_tokens": k,
                "draft_sample_method": self.draft_sample_method,
                "rejection_sample_method": self.rejection_sample_method, **backend}


class OutputsConfig(StrictModel):
    """How generated tokens travel from the LanguageModel to the Router: one TCP connection per
    (LanguageModel replica, Router replica) pair carries what vLLM's engine core produced in each
    step for all of that Router's requests in one frame, and the Router is vLLM's frontend for
    them (detokenizing, stop strings, logprobs); each request's own Serve call carries its
    cancellation and errors (`moonserve.pipeline.engine.output_wire`).
    """

    host: str | None = Field(None, description=(
        "The address the Router listens on for its channel (a random port, guarded by a "
        "token); null: this node's IP, as Ray knows it."))


class ResponsesConfig(StrictModel):
    """Stored Responses: `POST /v1/responses` keeps each turn (`store: true`, OpenAI's default) for
    `GET`, `DELETE`, `input_items` and `previous_response_id`, visible only to the API key that
    made it (docs/agents.md)."""

    database: str = Field("~/.cache/moonserve/responses.sqlite3", description=(
        "Where every Router replica reads and writes stored turns: a SQLite file (the replicas "
        "of one node) or a `redis://host:port/db` URL (every node of a cluster)."))
    retention_s: PositiveFloat = Field(30 * 86400.0, description=(
        "How long a stored response stays readable (OpenAI keeps them 30 days)."))
    max_stored_bytes: PositiveInt = Field(1 << 24, description=(
        "Largest request body a stored turn may come from (images included); a larger one must "
        "send `store: false` (400)."))

    @field_validator("database")
    @classmethod
    def _path_or_redis(cls, value: str) -> str:
        if "://" in value and not is_redis_url(value):
            raise ValueError(f"{value!r}: a SQLite file path or a redis://, rediss:// or "
                             "unix:// URL")
        return value


def is_redis_url(database: str) -> bool:
    """`router.responses.database` names a Redis server (redis-py's URL schemes), not a file."""
    return database.startswith(("redis://", "rediss://", "unix://"))


class RouterConfig(StrictModel):
    deployment: DeploymentOptions = Field(DeploymentOptions(max_ongoing_requests=256), description=(
        "Serve options of the Router; its max_ongoing_requests must hold its lanes (in flight "
        "plus queued)."))
    auth: AuthConfig = Field(AuthConfig(), description=(
        "API keys for `/v1/*` (`Authorization: Bearer <key>`); `/health` stays open."))
    limits: LimitsConfig = Field(LimitsConfig(), description=(
        "Per-request limits, enforced by the router before any engine work (400/413 naming "
        "them)."))
    lanes: LanesConfig = Field(LanesConfig(), description=(
        "Admission at the Router: `interactive` and `long_context` lanes, or one FIFO lane "
        "(docs/lanes.md)."))
    rate_limits: RateLimitsConfig = Field(RateLimitsConfig(), description=(
        "Per-client limits for the whole application (429 with Retry-After); with one set, the "
        "app runs a RateLimiter deployment."))
    outputs: OutputsConfig = Field(OutputsConfig(), description=(
        "How generated tokens travel from the LanguageModel to the Router."))
    responses: ResponsesConfig = Field(ResponsesConfig(), description=(
        "Where `POST /v1/responses` stores its turns, and for how long."))
    # - `proxy`: Ray Serve's proxy actor forwards each request, and each SSE event of it as a Ray
    #   streaming item. It listens on `http_options.host` only (the embedded default: 127.0.0.1).
    # - `haproxy`: Serve's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`, set by `moonserve serve` on
    #   the cluster it starts; a joined cluster needs it on every `ray start`). HAProxy listens on
    #   the HTTP port and forwards to each Router replica's own HTTP server (Serve's direct ingress,
    #   ports from 30000 on `http_options.host` too, which HAProxy on other nodes must reach), so
    #   no Ray hop carries tokens to the client. HAProxy's stats and metrics ports (8404, 9101)
    #   listen on every interface.
    ingress: Literal["proxy", "haproxy"] = Field("proxy", description=(
        "How HTTP clients reach the Router replicas, the same for every application of the "
        "cluster: `proxy` (Serve's proxy actor; configs/local.yaml) or `haproxy` (Serve's "
        "HAProxy mode, no Ray hop per token; configs/mi355x-k3.1-pro.yaml)."))

    @model_validator(mode="after")
    def _replica_holds_its_lanes(self) -> RouterConfig:
        # Otherwise Serve queues requests in front of the replica, where lanes cannot see them.
        need = self.lanes.capacity()
        if self.deployment.max_ongoing_requests < need:
            raise ValueError(
                f"deployment.max_ongoing_requests ({self.deployment.max_ongoing_requests}) is below "
                f"what the lanes hold (in flight + queued = {need}); raise it or shrink the lanes"
            )
        return self


class DrainConfig(StrictModel):
    """How long a Router, LanguageModel or DraftService replica that is scaled down or replaced
    may take to finish what it admitted (Serve's `graceful_shutdown_timeout_s` for them, unless
    their `deployment` sets one). Serve sends it no new requests and stops it as soon as its
    last request ends, so a long bound costs nothing when requests are short.

    The bound is the slowest admitted request: the longest lane queue timeout, then the largest
    `max_tokens` (`router.limits.max_tokens`, else the context length) at `min_tokens_per_s`;
    at most `max_s`.
    """

    min_tokens_per_s: PositiveFloat = Field(4.0, description=(
        "The slowest decode a stream may have and still finish during a drain."))
    max_s: PositiveFloat = Field(3600.0, description=(
        "The longest drain; also the drain when neither `router.limits.max_tokens` nor "
        "`language_model.engine.max_model_len` is set."))


class AppConfig(StrictModel):
    """`args` of the moonserve application in a Ray Serve config file."""

    router: RouterConfig = Field(RouterConfig(), description=(
        "The Router deployment, the HTTP ingress with the OpenAI API: auth, limits, lanes, rate "
        "limits, the output channel and ingress."))
    language_model: LanguageModelConfig = Field(LanguageModelConfig(), description=(
        "The LanguageModel deployment: one vLLM engine per replica, its chat format, placement "
        "and routing."))
    vision: VisionConfig | None = Field(None, description=(
        "Images in chat messages: Router -> ImagePreprocessor -> VisionEncoder -> "
        "LanguageModel; null: text only (image parts are a 400)."))
    draft: DraftConfig = Field(DraftConfig(), description=(
        "Speculative decoding: where the draft tokens come from; vLLM verifies them "
        "losslessly (docs/speculative.md)."))
    drain: DrainConfig = Field(DrainConfig(), description=(
        "How long a Router, LanguageModel or DraftService replica that is scaled down or "
        "replaced may take to finish what it admitted."))

    def autoscaled(self) -> list[str]:
        """The dotted names of the `autoscaling` sections set in this app."""
        deployments = {"router.deployment": self.router.deployment,
                       "language_model.deployment": self.language_model.deployment,
                       "draft.deployment": self.draft.deployment}
        if self.vision is not None:
            deployments["vision.preprocessor.deployment"] = self.vision.preprocessor.deployment
            deployments["vision.encoder.deployment"] = self.vision.encoder.deployment
        return [f"{name}.autoscaling" for name, options in deployments.items()
                if options.autoscaling is not None]

    def drain_s(self) -> float:
        """The graceful shutdown of the Router, LanguageModel and DraftService (`DrainConfig`)."""
        queued = max(lane.queue_timeout_s for lane in self.router.lanes.active().values())
        max_tokens = self.router.limits.max_tokens or self.language_model.engine.max_model_len
        if max_tokens is None:
            return self.drain.max_s
        return min(self.drain.max_s, queued + max_tokens / self.drain.min_tokens_per_s)

    @model_validator(mode="after")
    def _language_model_takes_admitted(self) -> AppConfig:
        # Admitted requests must reach the engine at once; health checks need a little room too.
        lm = self.language_model.deployment
        admitted = self.router.lanes.max_in_flight() * self.router.lanes.copies(
            self.router.deployment.max_replicas())
        if lm.max_ongoing_requests * lm.min_replicas() < admitted + 1:
            raise ValueError(
                f"language_model.deployment.max_ongoing_requests x (min) replicas "
                f"({lm.max_ongoing_requests} x {lm.min_replicas()}) must exceed the requests the "
                f"router lanes admit ({admitted}); raise it or lower router.lanes.*.max_in_flight"
            )
        uses_priority = self.router.lanes.enabled and len(
            {lane.priority for lane in self.router.lanes.active().values()}) > 1
        if uses_priority and self.language_model.engine.scheduling_policy != "priority":
            raise ValueError("router.lanes give the lanes different priorities but "
                             "language_model.engine.scheduling_policy is not 'priority'")
        background = self.language_model.engine.background_priority
        if self.router.lanes.enabled and background is not None and \
                self.router.lanes.interactive.priority >= background:
            raise ValueError(
                f"router.lanes.interactive.priority ({self.router.lanes.interactive.priority}) "
                f"must be better (lower) than language_model.engine.background_priority "
                f"({background}): chat prefills would be chunked as background work")
        if self.vision is not None and self.vision.handover == "prompt_embeds" and \
                not self.language_model.engine.enable_prompt_embeds:
            raise ValueError("vision.handover is prompt_embeds but language_model.engine."
                             "enable_prompt_embeds is false: image requests reach vLLM as prompt "
                             "embeddings")
        if self.vision is not None and self.vision.handover == "encoder_cache" and \
                self.language_model.engine.model == EMBEDDED_MODEL:
            raise ValueError("vision.handover encoder_cache needs a model vLLM serves as "
                             "multimodal (Kimi K2.5, K3) in language_model.engine.model; the "
                             "embedded model is text-only: use vision.handover: prompt_embeds")
        if self.draft.mode == "inline" and self.draft.drafter == "dspark" and \
                self.language_model.engine.model == EMBEDDED_MODEL:
            raise ValueError("draft.mode inline with drafter dspark needs a target checkpoint that "
                             "ships DSpark weights (Kimi K3, GPU); the embedded model has none: "
                             "use draft.mode service")
        if self.draft.mode == "inline" and self.draft.drafter == "dspark" and \
                self.draft.model == EMBEDDED_MODEL:
            raise ValueError("draft.mode inline with drafter dspark needs draft.model: the DSpark "
                             "draft checkpoint (K3DSparkModel), e.g. /models/kimi-k3.1-pro-dspark")
        return self


def load_serve_config(path: str | Path) -> dict:
    """Read a Ray Serve config file; returns the parsed YAML."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data.get("applications"):
        raise ValueError(f"{path}: not a Ray Serve config file (no 'applications' list)")
    return data


def write_with_args(path: str | Path, overrides: dict[str, dict], out: Path) -> Path:
    """A copy of a Ray Serve config file at `out` with sections of its first application's `args`
    updated key by key (`{"draft": {"mode": "off"}}` keeps the other `draft` keys)."""
    data = load_serve_config(path)
    args = data["applications"][0].setdefault("args", {})
    for section, values in overrides.items():
        args[section] = {**(args.get(section) or {}), **values}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def load_app_config(path: str | Path, app_name: str | None = None) -> AppConfig:
    """Validate the `args` of the moonserve application in a Ray Serve config file."""
    apps = load_serve_config(path)["applications"]
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{path}: no application named {app_name!r}")
    return AppConfig.model_validate(app.get("args") or {})
