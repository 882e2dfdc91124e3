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
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)

from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.sessions import SessionLimits
from moonserve.pipeline.vision.preprocess_config import DEFAULT_CONFIG as PREPROCESS_DEFAULTS
from moonserve.pipeline.vision.preprocess_config import PreprocessConfig
from moonserve.pipeline.vision.remote_policy import RemotePolicy

EMBEDDED_MODEL = "embedded"
# The embedded default, next to the package in a source checkout.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingOptions(StrictModel):
    """Ray Serve autoscaling of one deployment (replaces `num_replicas` when set)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 1
    target_ongoing_requests: PositiveFloat = 2.0
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is over max_replicas "
                             f"({self.max_replicas})")
        return self


class DeploymentOptions(StrictModel):
    """Ray Serve options of one deployment (the subset moonserve relies on)."""

    num_replicas: PositiveInt = 1
    autoscaling: AutoscalingOptions | None = None
    max_ongoing_requests: PositiveInt = 64
    num_cpus: float = Field(0.0, ge=0)
    # Ray custom resources each replica takes, which pin it to the nodes started with them
    # (`ray start --resources '{"moonserve_head": 1}'`); the LanguageModel's go in its
    # placement bundles instead.
    resources: dict[str, PositiveFloat] = Field(default_factory=dict)
    health_check_period_s: PositiveFloat = 5.0
    health_check_timeout_s: PositiveFloat = 30.0
    # How long a replica being scaled down or replaced may finish its requests. None: the app's
    # `drain` bound for the Router, LanguageModel and DraftService, Serve's 20 s for the others.
    graceful_shutdown_timeout_s: PositiveFloat | None = None

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
    # Decode context parallelism: the KV cache of one long request spread over this many TP ranks
    # (must divide tensor_parallel_size); what lets one 1M-token request fit a node.
    decode_context_parallel_size: PositiveInt = 1
    # "fp8" halves the KV cache (production); "auto" keeps the model dtype.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # "priority": lower `priority` first (the router's lanes set it); "fcfs": arrival order.
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    # Chunked prefill: at most this many prompt tokens of one request per engine step when other
    # requests are present (0: no cap), so a long prefill cannot hold interactive decode back.
    # Under the LaneScheduler only where it protects someone: prefills that share a step, or a
    # prefill beside better-priority decodes.
    long_prefill_token_threshold: int = Field(0, ge=0)
    # With "priority", true runs pipeline/engine/lane_scheduler.py's LaneScheduler: while a request of
    # the best priority present waits or prefills, prefill chunks of worse-priority requests sit
    # the step out (their decodes still run), so a long prompt never shares a step with a chat
    # prefill. It extends vLLM's synchronous scheduler, so it turns vLLM's async scheduling off
    # (CPU engines never have it; GPU engines do, so production keeps false).
    strict_prefill_priority: bool = False
    # Requests of this priority or worse (the long-context lane's) are background: a background
    # prefill takes at most `background_prefill_chunk_tokens` per step, alone too (vLLM gives a
    # lone prefill the whole budget), so the step a new chat request arrives during is short.
    # None: no background requests. Needs strict_prefill_priority.
    background_priority: int | None = None
    background_prefill_chunk_tokens: PositiveInt = 32
    seed: int = 0
    kv_cache_memory_bytes: PositiveInt | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    trust_remote_code: bool = False
    # Multimodal requests reach vLLM as prompt embeddings (needed with `vision.handover:
    # prompt_embeds`).
    enable_prompt_embeds: bool = False
    # vLLM's `worker_extension_cls`: a class mixed into every engine worker, whose methods
    # `LanguageModel.collective_rpc` calls (debugging and test probes); None: none.
    worker_extension_cls: str | None = None
    # vLLM's `mm_encoder_tp_mode` for an in-engine vision tower: "data" runs it replicated per
    # rank (K3's ViT heads do not divide TP 8); None: vLLM's default.
    mm_encoder_tp_mode: Literal["weights", "data"] | None = None
    # vLLM's `compilation_config.cudagraph_mode` (e.g. FULL_DECODE_ONLY) and `custom_ops`
    # (e.g. "+fused_rms_norm_gated"); None / empty: vLLM's defaults.
    cudagraph_mode: Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY",
                            "FULL_AND_PIECEWISE"] | None = None
    custom_ops: tuple[str, ...] = ()

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

    bundles: list[dict[str, float]] = Field(default_factory=lambda: [{"CPU": 1.0}], min_length=1)
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"


class ToolsConfig(StrictModel):
    """Tool calling (docs/tools.md)."""

    # vLLM's tool parser for the model's call format (vllm/tool_parsers): `hermes` for the
    # embedded model's template, `kimi_k3` for Kimi K3.1. None: requests with tools get a 400.
    parser: str | None = None
    # vLLM's --tool-strict-level: `parameter` holds every call's arguments to its tool's
    # schema in every tool_choice mode; `function` only the call envelope; `auto` as vLLM's
    # server does by default (arguments only for `strict: true` tools).
    strict_level: Literal["auto", "function", "parameter"] = "parameter"


class ReasoningConfig(StrictModel):
    # vLLM's reasoning parser (vllm/reasoning), e.g. `kimi_k3`: thinking goes to
    # `reasoning_content`, and structured outputs apply after it. None: no reasoning split.
    parser: str | None = None


class ChatConfig(StrictModel):
    """How chat requests are rendered and their outputs parsed, per served model."""

    # A chat template replacing the checkpoint's: a template shipped with moonserve by name
    # (pipeline/models/templates/<name>.jinja) or a path to a .jinja file. None: the checkpoint's.
    template: str | None = None
    tools: ToolsConfig = ToolsConfig()
    reasoning: ReasoningConfig = ReasoningConfig()


class RoutingConfig(StrictModel):
    """How callers pick a LanguageModel replica (matters with more than one).

    `prefix_affinity` (pipeline/router/prefix_affinity.py, Serve's request-router API): the least
    loaded of the replicas that were sent the longest prefix of the prompt (token-id blocks of
    `block_tokens`, images by content hash), else the one the request's `prompt_cache_key` (or
    `user`) hashes to, while its queue is at most `imbalance_threshold` longer than the lightest
    replica's; else power of two choices. `power_of_two`: Serve's default router.
    """

    policy: Literal["prefix_affinity", "power_of_two"] = "prefix_affinity"
    block_tokens: PositiveInt = 64
    imbalance_threshold: int = Field(4, ge=0)
    # Prefix keys remembered per caller (each Router replica; ~200 bytes each), least recently
    # used dropped: 100,000 keys of 64 tokens cover 6.4M tokens of distinct prefixes.
    max_keys: PositiveInt = 100_000

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
    engine: EngineConfig = EngineConfig()
    chat: ChatConfig = ChatConfig()
    placement: PlacementConfig = PlacementConfig()
    deployment: DeploymentOptions = DeploymentOptions()
    routing: RoutingConfig = RoutingConfig()
    # Environment for the replica and its vLLM processes (e.g. VLLM_CPU_OMP_THREADS_BIND).
    env: dict[str, str] = Field(default_factory=dict)

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
    # Image parts in one request (each is preprocessed and encoded).
    max_images: int = Field(8, ge=0)
    # Choices (`n`) in one request: they share the request's lane slot but each is an engine
    # sequence, so this bounds what one admitted request can put into the engine.
    max_choices: PositiveInt = 16

    @model_validator(mode="after")
    def _default_within_cap(self) -> LimitsConfig:
        if None not in (self.max_tokens, self.default_max_tokens) and \
                self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) is over max_tokens "
                             f"({self.max_tokens})")
        return self


class RateLimitsConfig(StrictModel):
    """Per client (API key; client address with auth off), for the whole application whatever the
    number of Router replicas (pipeline/api/rate_limits.py). Over a limit: 429 with Retry-After.

    With a limit set, the app runs a `RateLimiter` deployment that holds every client's buckets;
    each request costs the Router one call to it before the body is read, and one when it ends.
    If that call fails, the request goes ahead (a limiter restart must not stop the service).
    """

    # Requests each client may send per second (a second's worth at once); None: no limit.
    requests_per_s: PositiveFloat | None = None
    # Prompt plus completion tokens per client per minute; None: no limit.
    tokens_per_min: PositiveInt | None = None

    def enabled(self) -> bool:
        return self.requests_per_s is not None or self.tokens_per_min is not None


class LaneLimits(StrictModel):
    """One lane's admission limits toward the LanguageModel (for the application, or per Router
    replica: `LanesConfig.scope`)."""

    # Requests of this lane generating at once; the rest wait in the lane's queue.
    max_in_flight: PositiveInt
    # Requests waiting for a slot; one more is rejected at once (429/503 + Retry-After).
    max_queue: int = Field(ge=0)
    # A request still queued after this long is answered with 503 + Retry-After.
    queue_timeout_s: PositiveFloat = 60.0
    # vLLM request priority (lower is scheduled first; needs engine.scheduling_policy: priority).
    priority: int = 0

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
    (pipeline/api/admission.py), one call per request; with one, its own lanes are the
    application's. `scope: replica` gives every Router replica the limits for itself.
    """

    enabled: bool = True
    scope: Literal["application", "replica"] = "application"
    long_context_threshold_tokens: PositiveInt = 2048
    hint_header: str = "x-moonserve-lane"
    # Status of a rejection when a lane's queue is full: 429 (client backs off) or 503.
    reject_status: Literal[429, 503] = 429
    retry_after_s: PositiveInt = 1
    interactive: LaneLimits = LaneLimits(max_in_flight=48, max_queue=128, queue_timeout_s=30.0,
                                         priority=0)
    long_context: LaneLimits = LaneLimits(max_in_flight=8, max_queue=32, queue_timeout_s=300.0,
                                          priority=10)
    fifo: LaneLimits = LaneLimits(max_in_flight=56, max_queue=160, queue_timeout_s=300.0)

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


class ImagePreprocessorConfig(StrictModel):
    """ImagePreprocessor deployment: fetch, decode, validate, NaViT resize, normalize, patchify.

    The fields from `patch_size` to `background_rgb` are `PreprocessConfig`'s
    (pipeline/vision/preprocess_config.py: meanings and defaults); the layout fields mirror the
    checkpoint's `preprocessor_config.json` (`media_proc_cfg`). `remote` is a `RemotePolicy`
    (pipeline/vision/remote_policy.py): `http(s)` image URLs are off unless `allowed_hosts` names
    hosts.
    """

    patch_size: PositiveInt = PREPROCESS_DEFAULTS.patch_size
    merge_kernel: tuple[PositiveInt, PositiveInt] = PREPROCESS_DEFAULTS.merge_kernel
    in_patch_limit: PositiveInt = PREPROCESS_DEFAULTS.in_patch_limit
    patch_limit_on_one_side: PositiveInt = PREPROCESS_DEFAULTS.patch_limit_on_one_side
    image_mean: tuple[float, float, float] = PREPROCESS_DEFAULTS.image_mean
    image_std: tuple[float, float, float] = PREPROCESS_DEFAULTS.image_std
    max_image_bytes: PositiveInt = PREPROCESS_DEFAULTS.max_image_bytes
    max_image_pixels: PositiveInt = PREPROCESS_DEFAULTS.max_image_pixels
    background_rgb: tuple[int, int, int] = PREPROCESS_DEFAULTS.background_rgb
    remote: RemotePolicy = RemotePolicy()
    # Images decoded together per replica (serve.batch); a batch runs in one worker thread.
    max_batch_size: PositiveInt = 8
    batch_wait_timeout_s: float = Field(0.002, ge=0)
    deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=32)

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

    model: str = EMBEDDED_MODEL
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention_backend: Literal["auto", "sdpa", "triton", "naive"] = "auto"
    # Images packed into one forward pass (serve.batch across concurrent requests).
    max_batch_size: PositiveInt = 8
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    # Encoder outputs kept per replica, keyed by the SHA-256 of the image bytes (LRU by bytes).
    cache_bytes: int = Field(256 * 1024 * 1024, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # handover encoder_cache: the node-local store the encoder engine writes and the LanguageModel's
    # engine reads (pipeline/engine/ec_connector.py), and the bytes it may hold (least recently
    # used entries go first; None: no bound).
    store: str = "/dev/shm/moonserve-ec"
    store_max_bytes: PositiveInt | None = 4 * 1024**3
    # handover encoder_cache: the encoder engine's vLLM `gpu_memory_utilization` (on CPU, the
    # fraction of RAM it must find free at start); it holds the tower's weights and activations,
    # no KV cache.
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1)
    deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=32)


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

    handover: Literal["prompt_embeds", "encoder_cache"] = "prompt_embeds"
    image_placeholder: str = "<empty_output>"
    preprocessor: ImagePreprocessorConfig = ImagePreprocessorConfig()
    encoder: VisionEncoderConfig = VisionEncoderConfig()


class DraftConfig(StrictModel):
    """Speculative decoding: where the draft tokens come from; vLLM verifies them losslessly.

    - `service`: the DraftService deployment drafts (`drafter`), called every engine step by the
      LM's proposer (`moonserve.pipeline.engine.proposer`) over a direct connection. A call that misses
      `deadline_ms` yields no drafts for that step; the service down = no speculation.
      Drafters: `ngram` (prompt lookup), `dspark` (the DSpark model over tokens only; `embedded`
      by default), `dspark_context` (a K3 DSpark checkpoint at `model`, drafting from the
      target's hidden states at its `target_layer_ids`, which the proposer sends with each step;
      needs `language_model.engine.enforce_eager`: the proposer reads them with forward hooks).
    - `inline`: vLLM's own in-engine method: `dspark` (the separate DSpark draft checkpoint named by
      `model`, a `K3DSparkModel`; GPU only, production) or `ngram` (prompt lookup in the engine;
      the benchmark's baseline).
    - `off`: no speculation.
    """

    mode: Literal["service", "inline", "off"] = "off"
    drafter: Literal["ngram", "dspark", "dspark_context"] = "ngram"
    num_speculative_tokens: PositiveInt = 4
    # Prompt lookup n-gram sizes (vLLM's prompt_lookup_min/max), for both ngram drafters.
    ngram_min: PositiveInt = 2
    ngram_max: PositiveInt = 5
    # DSpark drafter weights (`embedded`: built by `moonserve prepare` from the embedded target).
    # With `inline`: vLLM's `speculative_config.model`; without it vLLM would read the draft from
    # the target checkpoint and, for K3, resolve it as DeepSeek-V4's `DSparkDraftModel`.
    model: str = EMBEDDED_MODEL
    # Inline dspark only (vLLM's speculative_config): the draft's attention backend (a vLLM
    # AttentionBackendEnum name such as TRITON_MLA; None: vLLM picks), how the draft samples and
    # how vLLM verifies a drafted block.
    attention_backend: str | None = None
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    rejection_sample_method: Literal["standard", "block"] = "standard"
    # Budget of one draft call as the engine step sees it; past it the step drafts nothing.
    deadline_ms: PositiveFloat = 25.0
    # After answering step t, draft step t+1 assuming all of step t's drafts are accepted.
    prefetch: bool = True
    # The LM replica's timeout on asking Serve where the DraftService is; meanwhile no drafts.
    service_timeout_s: PositiveFloat = 2.0
    # Bounds on the per-request contexts (pipeline/speculative/sessions.py).
    sessions: SessionLimits = SessionLimits()
    # With `service`: per request, draft only the tokens its acceptance so far makes worth it
    # (num_speculative_tokens is then the most; pipeline/speculative/adaptive.py).
    adaptive: AdaptivePolicy = AdaptivePolicy()
    num_gpus: float = Field(0.0, ge=0)
    deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=64)

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
        if self.drafter == "dspark_context" and self.mode != "service":
            raise ValueError("draft.drafter dspark_context is a DraftService drafter: set "
                             "draft.mode to service (inline, vLLM's own dspark reads the hidden "
                             "states in the engine)")
        if self.drafter == "dspark_context" and self.model == EMBEDDED_MODEL:
            raise ValueError("draft.model: drafter dspark_context needs a K3 DSpark checkpoint "
                             "(context_proj over the target's hidden states); the embedded "
                             "drafter reads tokens only")
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
    """How generated tokens travel from the LanguageModel to the Router.

    `channel`: one TCP connection per (LanguageModel replica, Router replica) pair carries each
    engine step's deltas for all of that Router's requests in one frame; each request's own Serve
    call carries its cancellation and errors (`moonserve.pipeline.api.output_wire`). `stream`: a
    Serve streaming call per request, one Ray item per delta (`moonserve bench overhead` compares
    them).
    """

    transport: Literal["channel", "stream"] = "channel"
    # The address the Router listens on for its channel (None: this node's IP, as Ray knows it).
    host: str | None = None


class RouterConfig(StrictModel):
    deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=256)
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    lanes: LanesConfig = LanesConfig()
    rate_limits: RateLimitsConfig = RateLimitsConfig()
    outputs: OutputsConfig = OutputsConfig()
    # How HTTP clients reach the Router replicas, for every application of the cluster:
    # - `proxy`: Ray Serve's proxy actor forwards each request, and each SSE event of it as a Ray
    #   streaming item. It listens on `http_options.host` only (the embedded default: 127.0.0.1).
    # - `haproxy`: Serve's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`, set by `moonserve serve` on
    #   the cluster it starts; a joined cluster needs it on every `ray start`). HAProxy listens on
    #   the HTTP port and forwards to each Router replica's own HTTP server (Serve's direct ingress,
    #   ports from 30000 on `http_options.host` too, which HAProxy on other nodes must reach), so
    #   no Ray hop carries tokens to the client. HAProxy's stats and metrics ports (8404, 9101)
    #   listen on every interface.
    ingress: Literal["proxy", "haproxy"] = "proxy"

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

    # The slowest decode a stream may have and still finish during a drain.
    min_tokens_per_s: PositiveFloat = 4.0
    max_s: PositiveFloat = 3600.0


class AppConfig(StrictModel):
    """`args` of the moonserve application in a Ray Serve config file."""

    router: RouterConfig = RouterConfig()
    language_model: LanguageModelConfig = LanguageModelConfig()
    # None: text only (image parts are a 400).
    vision: VisionConfig | None = None
    draft: DraftConfig = DraftConfig()
    drain: DrainConfig = DrainConfig()

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
        if self.draft.drafter == "dspark_context" and \
                not self.language_model.engine.enforce_eager:
            raise ValueError("draft.drafter dspark_context needs language_model.engine."
                             "enforce_eager: true (the proposer reads the target's hidden states "
                             "with forward hooks, which a compiled graph skips)")
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
