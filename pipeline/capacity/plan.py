"""Capacity planner behind `moonserve plan`: weights, KV/state, concurrency and a decode roofline.

Pure arithmetic over a `ModelSpec` (and an optional `DraftSpec`) and a `HardwareSpec`, for one
node running one vLLM engine with tensor parallelism (TP) and optional decode context parallelism
(DCP). It counts what vLLM 0.32 allocates for a hybrid MLA + KDA model: MLA latent pages with no
sparse-indexer cache (vLLM's Kimi K3 builds its MLA layers with `indexer=None`), KDA state pages
padded to the attention page and grouped as `kv_cache_utils` groups them (`hybrid_kv_layout`), a
speculative draft's weights and its MLA KV layers, and the runtime reserve as separate terms.
Every number is an `Assumption` with its source; `report.format_plan` prints them all. The models
and hardware it plans for are data in `registry` (Kimi K3.1 Pro, its DSpark draft, MI355X);
nothing here knows a particular model.

Units: bytes, bytes/s, seconds, tokens. GB = 1e9 bytes throughout.

Example:
    >>> from moonserve.pipeline.capacity.registry import DRAFTS, HARDWARE, MODELS
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"], draft=DRAFTS["kimi-k3-dspark"],
    ...          kv_cache=KVCacheSettings(num_speculative_tokens=7))
    >>> round(p.used_bytes_per_gpu_at_start / 1e9, 2)
    196.31
    >>> p.kv_layout.block_size, p.kv_layout.group_size, p.kv_layout.kda_padding_layers
    (1536, 29, 18)
    >>> [(row.context_len, row.max_concurrent_requests) for row in p.concurrency]
    [(8192, 81), (131072, 22), (1048576, 3)]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from moonserve.pipeline.capacity.checkpoint import CheckpointReport, GroupSummary

GB = 1e9

# Bytes per parameter of each weight dtype.
DTYPE_BYTES = {
    "mxfp4": (4 + 8 / 32) / 8,  # 4-bit E2M1 + one E8M0 scale byte per 32 elements = 4.25 bits
    "fp8": 1.0,
    "bf16": 2.0,
    "fp32": 4.0,
}

# vLLM 0.32 constants the KV layout follows (paths under vllm/).
# platforms/interface.py `_align_hybrid_block_size`: a hybrid MLA + mamba-like model's block size
# is a multiple of 128 tokens ("TRTLLM/FlashInfer MLA decode kernels ... multiple of 128").
MLA_HYBRID_BLOCK_ALIGNMENT = 128
# v1/attention/backends/mla/triton_mla.py `get_supported_kernel_block_sizes`: MultipleOf(16), the
# MLA backend of the AMD K3 recipes; config/cache.py DEFAULT_BLOCK_SIZE is 16 as well.
MLA_KERNEL_BLOCK_ALIGNMENT = 16
# v1/core/kv_cache_utils.py `_get_kv_cache_groups_uniform_page_size`: the group size is the
# smallest layer type's count unless the largest has fewer than 1.5x as many layers.
GROUP_SIZE_MAX_RATIO = 1.5
# v1/core/block_pool.py: block 0 of the pool is the null block, never handed to a request.
NULL_BLOCKS = 1
# v1/attention/backends/mla/triton_mla.py `_compute_num_kv_splits`: the split-KV decode splits
# next_power_of_2(max_seq_len // 512), capped at 2 per compute unit.
TRITON_MLA_MIN_WORK_PER_SPLIT = 512
TRITON_MLA_SPLITS_PER_COMPUTE_UNIT = 2
TRITON_MLA_LOGIT_BYTES = 4  # float32 partial logits and the log-sum-exp

# routed_expert: only the experts a batch routes to are read per decode step.
# dense: read in full every decode step. embedding_lookup: only the batch's rows are read.
# vision: the ViT vLLM builds inside the engine, on every GPU; not read in decode.
# draft: the speculative draft model's own weights; outside the one-token decode roofline.
Role = Literal["routed_expert", "dense", "embedding_lookup", "vision", "draft"]
# The target's groups a DSpark draft reads (embedding and LM head): vLLM's inline draft shares
# them, a DraftService loads its own copy.
DRAFT_SHARED_GROUPS = ("embed_tokens", "lm_head")
MambaCacheMode = Literal["none", "align"]

SOURCE_PREFIXES = ("brief", "vendor spec", "assumption:", "derived:", "input:", "measured:",
                   "vllm:", "checkpoint config:")


@dataclass(frozen=True)
class Assumption:
    """One input number and where it comes from.

    `source` starts with one of SOURCE_PREFIXES: "brief" (the product brief), "vendor spec",
    "vllm: <file>" (read off the installed vLLM), "checkpoint config: <repo>" (a published
    config.json), "assumption: <what> because <why>", "derived: <formula>", "input: <who sets it>"
    or "measured: <which checkpoint>" (`moonserve plan --checkpoint`).
    """

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class ParamGroup:
    """Weights of one component, stored in one dtype.

    Nominal groups derive bytes from `dtype`; measured ones (`with_checkpoint`) carry the bytes
    check-checkpoint read off the safetensors headers, per GPU at the TP size they were measured at.
    """

    name: str
    num_params: int
    dtype: str  # key of DTYPE_BYTES; a measured group's storage format
    role: Role
    tp_sharded: bool  # False: every TP rank holds a full copy
    measured_bytes: float | None = None
    measured_bytes_per_gpu: float | None = None
    measured_tensor_parallel_size: int | None = None

    @property
    def num_bytes(self) -> float:
        if self.measured_bytes is not None:
            return self.measured_bytes
        return self.num_params * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model; every scalar has a same-named Assumption.

    `runtime_reserve` holds the per-GPU bytes vLLM's start-up profiling takes beside the weights
    (activation peak, graph pools, communication buffers), one Assumption per term, in bytes.
    `nominal_weight_inputs` names the assumptions that only feed the nominal `param_groups`
    (geometry, parameter totals, dtype sizes): `with_checkpoint` drops them when measured weights
    replace those groups.
    """

    name: str
    param_groups: tuple[ParamGroup, ...]
    num_experts: int
    num_experts_per_token: int
    num_kda_layers: int
    num_mla_layers: int
    kv_lora_rank: int  # MLA latent elements per token per layer
    qk_rope_head_dim: int  # MLA rope key elements per token per layer (stored even when NoPE)
    kv_cache_bytes_per_element: float
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_kernel_size: int
    kda_recurrent_state_bytes_per_element: float
    kda_conv_state_bytes_per_element: float
    max_context_len: int
    runtime_reserve: tuple[Assumption, ...]
    assumptions: tuple[Assumption, ...]
    nominal_weight_inputs: tuple[str, ...] = ()


# ModelSpec fields that are not one number; every other field has a same-named Assumption.
NON_SCALAR_FIELDS = ("name", "param_groups", "runtime_reserve", "assumptions",
                     "nominal_weight_inputs")


def scalar_field_names() -> tuple[str, ...]:
    """ModelSpec's one-number fields (layer counts, geometry, element sizes)."""
    return tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name not in NON_SCALAR_FIELDS)


@dataclass(frozen=True)
class DraftSpec:
    """A speculative draft model vLLM loads beside the target (its own weights and MLA layers).

    Its MLA layers get KV cache pages like the target's (vLLM allocates one KV spec per attention
    layer it builds); embeddings and LM head it shares with the target are not in `param_groups`.
    """

    name: str
    param_groups: tuple[ParamGroup, ...]
    num_mla_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    assumptions: tuple[Assumption, ...]
    num_attention_heads: int = 0  # MLA query heads (all ranks); sizes a TRITON_MLA workspace


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    gpus_per_node: int
    hbm_bytes_per_gpu: float
    hbm_bandwidth_bytes_per_s: float  # per GPU
    assumptions: tuple[Assumption, ...]
    compute_units: int = 0  # per GPU (CUs / SMs); sizes a TRITON_MLA workspace; 0: unknown


@dataclass(frozen=True)
class KVCacheSettings:
    """Engine settings that shape vLLM's KV cache: speculation and prefix caching."""

    num_speculative_tokens: int = 0
    # vLLM sets mamba_cache_mode "align" when prefix caching is on (model_executor/models/
    # config.py MambaModelConfig), else "none".
    enable_prefix_caching: bool = False
    # Extra KDA state page per sequence for prefill checkpoints in "align" mode (MambaSpec
    # num_prefill_checkpoint_blocks, set by the K3 KDA layer's get_kv_cache_spec).
    kda_prefill_checkpoint_blocks: int = 0

    @property
    def mamba_cache_mode(self) -> MambaCacheMode:
        return "align" if self.enable_prefix_caching else "none"


@dataclass(frozen=True)
class EngineLimits:
    """Engine settings that size memory vLLM holds outside its KV accounting, and the request
    length vLLM checks at start (`moonserve plan --config` reads them from the config)."""

    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_context_len
    # "TRITON_MLA" (the draft's backend in the production config): its split-KV workspace.
    draft_attention_backend: str | None = None
    # The VisionEncoder's encoder-only engine on one of the node's GPUs (its vLLM
    # gpu_memory_utilization); 0: none on these GPUs.
    encoder_gpu_memory_utilization: float = 0.0
    # The DraftService on one of the node's GPUs (draft.num_gpus, its allocator's cap), and the
    # weights it loads there (0 for a model-free drafter); 0: none on these GPUs.
    draft_service_gpu_share: float = 0.0
    draft_service_weight_bytes: float = 0.0


@dataclass(frozen=True)
class HybridKVLayout:
    """Per-GPU KV cache layout vLLM builds for MLA + KDA layers (one engine, one TP rank).

    Every MLA layer (target and draft) holds `block_size` tokens per page; every KDA layer holds
    one sequence's state per page, padded to the MLA page. Layers are split into groups of
    `group_size`; a block is one page of every layer of a group, so padding layers cost memory.
    """

    mla_bytes_per_token_per_layer: float  # latent + rope, no indexer key
    kda_state_bytes_per_layer: float  # conv + recurrent state of one sequence on one GPU
    block_size: int  # tokens per MLA page
    page_bytes: float
    kda_page_padding_bytes: float  # page_bytes - kda_state_bytes_per_layer
    num_mla_layers: int  # target + draft
    group_size: int
    num_mla_groups: int
    num_kda_groups: int
    mla_padding_layers: int
    kda_padding_layers: int
    bytes_per_block: float  # group_size * page_bytes
    kda_pages_per_sequence: int  # per KDA group: 1 + k ("none") or 2 + k + checkpoints ("align")


@dataclass(frozen=True)
class WeightShare:
    name: str
    dtype: str
    role: Role
    tp_sharded: bool
    num_params: int
    bytes_total: float  # one copy of the component
    bytes_per_gpu: float


@dataclass(frozen=True)
class RequestFootprint:
    """HBM one request of `context_len` tokens holds, at one DCP size, in whole vLLM blocks."""

    context_len: int
    decode_context_parallel_size: int
    kv_bytes_per_gpu: float  # MLA blocks (target + draft layers)
    state_bytes_per_gpu: float  # KDA state blocks (padded pages and padding layers included)
    bytes_per_gpu: float
    bytes_per_node: float  # summed over the TP group, copies included
    fits_on_one_node: bool  # bytes_per_gpu <= the KV/state pool per GPU


@dataclass(frozen=True)
class ConcurrencyRow:
    context_len: int
    bytes_per_request_per_gpu: float
    max_concurrent_requests: int  # memory bound only; vLLM's max_num_seqs may cap it lower


@dataclass(frozen=True)
class DecodeRoofline:
    """HBM-bandwidth upper bound on decode throughput (one token per sequence per step)."""

    batch_size: int
    context_len: int
    expected_distinct_experts: float  # per MoE layer
    weight_bytes_per_gpu: float
    kv_state_bytes_per_gpu: float
    step_bytes_per_node: float
    aggregate_bandwidth_bytes_per_s: float
    step_time_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class ReserveTerm:
    name: str
    bytes_per_gpu: float
    source: str


@dataclass(frozen=True)
class Plan:
    model_name: str
    hardware_name: str
    draft_name: str | None
    tensor_parallel_size: int
    decode_context_parallel_size: int
    gpu_memory_utilization: float
    num_speculative_tokens: int
    mamba_cache_mode: str
    total_params: int  # target language model; vision encoder and draft excluded
    activated_params: float  # per token
    weights: tuple[WeightShare, ...]  # target, in-engine ViT, draft
    weight_bytes_total: float
    weight_bytes_per_gpu: float
    runtime_reserve: tuple[ReserveTerm, ...]
    runtime_reserve_bytes_per_gpu: float
    used_bytes_per_gpu_at_start: float  # weights + runtime reserve, before KV
    kv_pool_bytes_per_gpu: float  # for KV cache and KDA state
    max_model_len: int
    # HBM outside gpu_memory_utilization: on every GPU (the TRITON_MLA workspace) and on the one
    # GPU that also holds the encoder engine.
    outside_pool: tuple[ReserveTerm, ...]
    hbm_left_bytes_per_gpu: float  # on the busiest GPU, after the engine's share and all of it
    kv_layout: HybridKVLayout
    kv_bytes_per_token: float  # one copy, all MLA layers (target + draft), unpadded
    kv_bytes_per_token_per_gpu: float
    state_bytes_per_sequence: float  # one copy, all KDA layers, one state page each, unpadded
    state_bytes_per_sequence_per_gpu: float
    max_context_requests: tuple[RequestFootprint, ...]  # one per DCP size dividing TP
    concurrency: tuple[ConcurrencyRow, ...]
    roofline: tuple[DecodeRoofline, ...]
    assumptions: tuple[Assumption, ...]


def weight_shares(model: ModelSpec, tensor_parallel_size: int,
                  draft: DraftSpec | None = None) -> tuple[WeightShare, ...]:
    groups = model.param_groups + (draft.param_groups if draft else ())
    return tuple(_weight_share(g, tensor_parallel_size) for g in groups)


def _weight_share(group: ParamGroup, tensor_parallel_size: int) -> WeightShare:
    per_gpu = group.num_bytes / tensor_parallel_size if group.tp_sharded else group.num_bytes
    if group.measured_bytes_per_gpu is not None:
        if group.measured_tensor_parallel_size != tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: weights of "
                             f"{group.name} were measured at TP="
                             f"{group.measured_tensor_parallel_size}; measure again at this TP")
        per_gpu = group.measured_bytes_per_gpu  # vocab and expert padding included
    return WeightShare(group.name, group.dtype, group.role, group.tp_sharded, group.num_params,
                       group.num_bytes, per_gpu)


def language_model_params(model: ModelSpec) -> int:
    return sum(g.num_params for g in model.param_groups if g.role not in ("vision", "draft"))


def activated_params(model: ModelSpec) -> float:
    """Parameters one token uses: every non-expert weight + k of E routed experts."""
    routed = sum(g.num_params for g in model.param_groups if g.role == "routed_expert")
    active_fraction = model.num_experts_per_token / model.num_experts
    return language_model_params(model) - routed + routed * active_fraction


def mla_bytes_per_token_per_layer(kv_lora_rank: int, qk_rope_head_dim: int,
                                  kv_cache_bytes_per_element: float) -> float:
    """vLLM's MLAAttentionSpec page per token: one latent "head" of kv_lora + rope, no V."""
    return (kv_lora_rank + qk_rope_head_dim) * kv_cache_bytes_per_element


def kda_state_bytes_per_layer(model: ModelSpec, tensor_parallel_size: int,
                              num_speculative_tokens: int) -> float:
    """One sequence's KDA state in one layer on one GPU, as vLLM shapes it.

    vLLM `MambaStateShapeCalculator.kda_state_shape`: conv state [3*H*D/TP, K - 1 + k] (q, k, v
    short convs, k = num_speculative_tokens) and recurrent state [H/TP, D, D].
    """
    heads, dim = model.kda_num_heads // tensor_parallel_size, model.kda_head_dim
    conv_len = model.kda_conv_kernel_size - 1 + num_speculative_tokens
    conv = 3 * heads * dim * conv_len * model.kda_conv_state_bytes_per_element
    recurrent = heads * dim * dim * model.kda_recurrent_state_bytes_per_element
    return conv + recurrent


def hybrid_kv_layout(model: ModelSpec, tensor_parallel_size: int,
                     settings: KVCacheSettings = KVCacheSettings(),
                     draft: DraftSpec | None = None) -> HybridKVLayout:
    """The KV layout vLLM builds: block size, page padding, layer groups (see HybridKVLayout)."""
    mla_token = mla_bytes_per_token_per_layer(model.kv_lora_rank, model.qk_rope_head_dim,
                                              model.kv_cache_bytes_per_element)
    _check_draft_kv(model, draft, mla_token)
    state = kda_state_bytes_per_layer(model, tensor_parallel_size,
                                      settings.num_speculative_tokens)
    block_size = _hybrid_block_size(state, mla_token)
    page = block_size * mla_token
    num_mla = model.num_mla_layers + (draft.num_mla_layers if draft else 0)
    group_size = _group_size(num_mla, model.num_kda_layers)
    mla_groups, kda_groups = (math.ceil(n / group_size) for n in (num_mla, model.num_kda_layers))
    return HybridKVLayout(
        mla_token, state, block_size, page, page - state, num_mla, group_size, mla_groups,
        kda_groups, mla_groups * group_size - num_mla,
        kda_groups * group_size - model.num_kda_layers, group_size * page,
        _kda_pages_per_sequence(settings))


def _check_draft_kv(model: ModelSpec, draft: DraftSpec | None, mla_token: float) -> None:
    if draft is None:
        return
    draft_token = mla_bytes_per_token_per_layer(draft.kv_lora_rank, draft.qk_rope_head_dim,
                                                model.kv_cache_bytes_per_element)
    if draft_token != mla_token:
        # vLLM would put the draft's layers in their own group with another page size
        # (unify_kv_cache_spec_page_size); this planner models only the shared-page case.
        raise ValueError(f"draft {draft.name}: MLA page per token {draft_token:g} B differs from "
                         f"the target's {mla_token:g} B; the planner needs the same latent size "
                         "(plan without it: `moonserve plan --draft none`)")


def _hybrid_block_size(state_bytes: float, mla_token_bytes: float) -> int:
    # platforms/interface.py `_align_hybrid_block_size`: the smallest multiple of 128 tokens
    # whose MLA page holds one KDA state, rounded up to every backend's kernel block (16).
    align = MLA_HYBRID_BLOCK_ALIGNMENT
    block = align * math.ceil(state_bytes / (align * mla_token_bytes))
    return MLA_KERNEL_BLOCK_ALIGNMENT * math.ceil(block / MLA_KERNEL_BLOCK_ALIGNMENT)


def _group_size(num_mla_layers: int, num_kda_layers: int) -> int:
    smallest, largest = sorted((num_mla_layers, num_kda_layers))
    return largest if largest < smallest * GROUP_SIZE_MAX_RATIO else smallest


def _kda_pages_per_sequence(settings: KVCacheSettings) -> int:
    # v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes: 1 + num_speculative_blocks
    # ("none"), 2 + num_speculative_blocks + num_prefill_checkpoint_blocks ("align");
    # num_speculative_blocks = num_speculative_tokens (mamba/abstract.py get_kv_cache_spec).
    k = settings.num_speculative_tokens
    if settings.mamba_cache_mode == "align":
        return 2 + k + settings.kda_prefill_checkpoint_blocks
    return 1 + k


def request_blocks(layout: HybridKVLayout, context_len: int,
                   decode_context_parallel_size: int) -> tuple[int, int]:
    """(MLA blocks, KDA blocks) one request holds on one GPU.

    MLA: AttentionSpec.max_num_blocks_per_req, cdiv(tokens, block_size * DCP) per MLA group;
    KDA: its pages per sequence in every KDA group (state is not split by DCP).
    """
    mla = layout.num_mla_groups * math.ceil(
        context_len / (layout.block_size * decode_context_parallel_size))
    return mla, layout.num_kda_groups * layout.kda_pages_per_sequence


def request_bytes_per_gpu(layout: HybridKVLayout, context_len: int,
                          decode_context_parallel_size: int) -> float:
    return sum(request_blocks(layout, context_len, decode_context_parallel_size)) * (
        layout.bytes_per_block)


def request_footprint(layout: HybridKVLayout, context_len: int, tensor_parallel_size: int,
                      decode_context_parallel_size: int,
                      kv_pool_bytes_per_gpu: float) -> RequestFootprint:
    mla, kda = request_blocks(layout, context_len, decode_context_parallel_size)
    kv, state = mla * layout.bytes_per_block, kda * layout.bytes_per_block
    return RequestFootprint(context_len, decode_context_parallel_size, kv, state, kv + state,
                            (kv + state) * tensor_parallel_size,
                            kv + state <= usable_pool_blocks(layout, kv_pool_bytes_per_gpu)
                            * layout.bytes_per_block)


def usable_pool_blocks(layout: HybridKVLayout, kv_pool_bytes_per_gpu: float) -> int:
    # kv_cache_utils.get_kv_cache_config_from_groups: available_memory // bytes_per_block.
    return max(0, math.floor(kv_pool_bytes_per_gpu / layout.bytes_per_block) - NULL_BLOCKS)


def max_concurrent_requests(layout: HybridKVLayout, kv_pool_bytes_per_gpu: float,
                            context_len: int, decode_context_parallel_size: int) -> int:
    blocks = sum(request_blocks(layout, context_len, decode_context_parallel_size))
    return usable_pool_blocks(layout, kv_pool_bytes_per_gpu) // blocks


def expected_distinct_experts(num_experts: int, num_experts_per_token: int,
                              batch_size: int) -> float:
    """Experts per MoE layer a batch touches under uniform independent routing: E(1-(1-k/E)^B)."""
    return num_experts * (1 - (1 - num_experts_per_token / num_experts) ** batch_size)


def decode_weight_bytes_per_gpu(model: ModelSpec, tensor_parallel_size: int,
                                batch_size: int) -> float:
    touched = expected_distinct_experts(model.num_experts, model.num_experts_per_token, batch_size)
    read_fraction = {"routed_expert": touched / model.num_experts, "dense": 1.0,
                     "embedding_lookup": 0.0, "vision": 0.0, "draft": 0.0}
    shares = weight_shares(model, tensor_parallel_size)
    return sum(s.bytes_per_gpu * read_fraction[s.role] for s in shares)


def decode_kv_state_bytes_per_gpu(model: ModelSpec, context_len: int, tensor_parallel_size: int,
                                  decode_context_parallel_size: int) -> float:
    """Cache bytes one sequence's decode step reads on one GPU (target model, no speculation).

    Per MLA layer: dense attention reads every cached token's latent + rope (vLLM's K3 MLA has
    no sparse indexer); DCP ranks each read 1/DCP. KDA reads and writes its state once (2x).
    """
    latent = mla_bytes_per_token_per_layer(model.kv_lora_rank, model.qk_rope_head_dim,
                                           model.kv_cache_bytes_per_element)
    mla = model.num_mla_layers * context_len * latent / decode_context_parallel_size
    state = model.num_kda_layers * kda_state_bytes_per_layer(model, tensor_parallel_size, 0)
    return mla + 2 * state


def decode_roofline(model: ModelSpec, hardware: HardwareSpec, batch_size: int, context_len: int,
                    tensor_parallel_size: int, decode_context_parallel_size: int) -> DecodeRoofline:
    weights = decode_weight_bytes_per_gpu(model, tensor_parallel_size, batch_size)
    kv = batch_size * decode_kv_state_bytes_per_gpu(
        model, context_len, tensor_parallel_size, decode_context_parallel_size)
    # TP ranks read in parallel and symmetrically, so per-GPU bytes / per-GPU bandwidth is the
    # node's bytes / aggregate bandwidth.
    step_time_s = (weights + kv) / hardware.hbm_bandwidth_bytes_per_s
    touched = expected_distinct_experts(model.num_experts, model.num_experts_per_token, batch_size)
    return DecodeRoofline(batch_size, context_len, touched, weights, kv,
                          (weights + kv) * tensor_parallel_size,
                          hardware.hbm_bandwidth_bytes_per_s * tensor_parallel_size,
                          step_time_s, batch_size / step_time_s)


def triton_mla_num_kv_splits(max_model_len: int, compute_units: int) -> int:
    """vLLM's `_compute_num_kv_splits` at the engine's longest sequence."""
    ideal = 1 << (max(1, max_model_len // TRITON_MLA_MIN_WORK_PER_SPLIT) - 1).bit_length()
    return min(ideal, compute_units * TRITON_MLA_SPLITS_PER_COMPUTE_UNIT)


def triton_mla_workspace_bytes(max_num_seqs: int, query_len: int, heads_per_rank: int,
                               max_model_len: int, compute_units: int, kv_lora_rank: int) -> float:
    """The split-KV logits buffer TritonMLAMetadataBuilder reserves at start
    (`_reserve_attn_logits_workspace`): [max_num_seqs x query_len rows, heads per rank (x DCP),
    splits at max_model_len, kv_lora_rank + 1] in float32, one buffer shared by all its layers
    (v1/worker/workspace.py). With a draft, query_len is 1 + num_speculative_tokens (vLLM's
    reorder_batch_threshold for uniform multi-token decode)."""
    splits = triton_mla_num_kv_splits(max_model_len, compute_units)
    return (max_num_seqs * query_len * heads_per_rank * splits * (kv_lora_rank + 1)
            * TRITON_MLA_LOGIT_BYTES)


def outside_pool_terms(hardware: HardwareSpec, tensor_parallel_size: int,
                       decode_context_parallel_size: int, draft: DraftSpec | None,
                       num_speculative_tokens: int, max_model_len: int,
                       limits: EngineLimits) -> tuple[ReserveTerm, ...]:
    """HBM a GPU holds beside vLLM's `gpu_memory_utilization` share."""
    terms = []
    if limits.draft_attention_backend == "TRITON_MLA" and draft is not None:
        if not hardware.compute_units or not draft.num_attention_heads:
            raise ValueError(f"draft attention TRITON_MLA: its workspace needs {hardware.name}'s "
                             f"compute units and {draft.name}'s attention heads")
        heads = draft.num_attention_heads // tensor_parallel_size * decode_context_parallel_size
        terms.append(ReserveTerm(
            "triton_mla_workspace (every GPU)", triton_mla_workspace_bytes(
                limits.max_num_seqs, 1 + num_speculative_tokens, heads, max_model_len,
                hardware.compute_units, draft.kv_lora_rank),
            "vllm: v1/attention/backends/mla/triton_mla.py _reserve_attn_logits_workspace, "
            "max_num_seqs x (1+k) rows x heads per rank x splits "
            f"({triton_mla_num_kv_splits(max_model_len, hardware.compute_units)}) x "
            "(kv_lora_rank+1) x 4 B; reserved after vLLM's memory profiling "
            "(v1/worker/gpu/cudagraph_utils.py), so outside gpu_memory_utilization"))
    if limits.encoder_gpu_memory_utilization:
        terms.append(ReserveTerm(
            "vision_encoder_engine (one GPU)",
            limits.encoder_gpu_memory_utilization * hardware.hbm_bytes_per_gpu,
            "input: vision.encoder.gpu_memory_utilization x HBM, the encoder-only vLLM engine "
            "beside one TP rank (vision.encoder.num_gpus)"))
    if limits.draft_service_gpu_share:
        cap = limits.draft_service_gpu_share * hardware.hbm_bytes_per_gpu
        if limits.draft_service_weight_bytes > cap:
            raise ValueError(f"draft.num_gpus={limits.draft_service_gpu_share}: the DraftService "
                             f"may hold {cap / GB:.2f} GB of a {hardware.name} GPU, less than "
                             f"the {limits.draft_service_weight_bytes / GB:.2f} GB of weights it "
                             "loads (the draft, the target's embedding and LM head): raise it")
        terms.append(ReserveTerm(
            "draft_service (one GPU)", cap,
            "input: draft.num_gpus x HBM, the DraftService's CUDA allocator cap "
            "(deployments/draft.py set_per_process_memory_fraction) beside one TP rank; "
            f"its weights {limits.draft_service_weight_bytes / GB:.2f} GB of it"))
    return tuple(terms)


def draft_service_weight_bytes(model: ModelSpec, draft: DraftSpec) -> float:
    """What a DraftService loads for `draft`: all of the draft's weights on one GPU, and its own
    copy of the target's embedding and LM head (`models.dspark.target_shared_tensors`), which
    vLLM's inline draft shares with the target instead."""
    shared = [g for g in model.param_groups if g.name in DRAFT_SHARED_GROUPS]
    if {g.name for g in shared} != set(DRAFT_SHARED_GROUPS):
        raise ValueError(f"{model.name}: no {' and '.join(DRAFT_SHARED_GROUPS)} weights to size "
                         "the DraftService's copy by")
    return sum(g.num_bytes for g in draft.param_groups + tuple(shared))


def runtime_reserve_terms(model: ModelSpec) -> tuple[ReserveTerm, ...]:
    return tuple(ReserveTerm(a.name, a.value, a.source) for a in model.runtime_reserve)


def plan(model: ModelSpec, hardware: HardwareSpec, tensor_parallel_size: int = 8,
         decode_context_parallel_size: int = 1,
         contexts: tuple[int, ...] = (8192, 131072, 1048576), *,
         gpu_memory_utilization: float = 0.9, draft: DraftSpec | None = None,
         kv_cache: KVCacheSettings = KVCacheSettings(), roofline_context_len: int = 8192,
         roofline_batch_sizes: tuple[int, ...] = (1, 64),
         limits: EngineLimits = EngineLimits()) -> Plan:
    """Capacity of one engine with `tensor_parallel_size` GPUs of one node.

    `gpu_memory_utilization` is vLLM's: the engine may use that fraction of each GPU's HBM.
    `draft` adds a speculative draft's weights and MLA KV layers; `kv_cache` holds the engine
    settings that size KDA state (speculative tokens, prefix caching). Concurrency is at
    `decode_context_parallel_size`; `max_context_requests` shows one `model.max_context_len`-token
    request at every DCP size dividing TP. `limits` adds what vLLM holds outside its share (a
    TRITON_MLA draft's workspace, the encoder engine's and the DraftService's shares of one GPU,
    summed as if on the same GPU) and the request length
    vLLM checks at start. Raises ValueError on a layout vLLM would refuse, on a GPU those do not
    fit, and where one `max_model_len` request does not fit the KV pool (vLLM refuses to start).
    Example: see the module docstring.
    """
    _validate(model, hardware, tensor_parallel_size, decode_context_parallel_size, contexts,
              gpu_memory_utilization, roofline_context_len)
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    shares = weight_shares(model, tp, draft)
    weight_per_gpu = sum(s.bytes_per_gpu for s in shares)
    reserve = runtime_reserve_terms(model)
    reserve_total = sum(r.bytes_per_gpu for r in reserve)
    used = weight_per_gpu + reserve_total
    pool = gpu_memory_utilization * hardware.hbm_bytes_per_gpu - used
    layout = hybrid_kv_layout(model, tp, kv_cache, draft)
    max_model_len = limits.max_model_len or model.max_context_len
    outside = outside_pool_terms(hardware, tp, dcp, draft, kv_cache.num_speculative_tokens,
                                 max_model_len, limits)
    left = (1 - gpu_memory_utilization) * hardware.hbm_bytes_per_gpu - sum(
        t.bytes_per_gpu for t in outside)
    _check_fits(layout, pool, left, max_model_len, dcp, outside, gpu_memory_utilization)
    kv_token = layout.num_mla_layers * layout.mla_bytes_per_token_per_layer
    state_seq = model.num_kda_layers * kda_state_bytes_per_layer(
        model, 1, kv_cache.num_speculative_tokens)
    return Plan(
        model.name, hardware.name, draft.name if draft else None, tp, dcp,
        gpu_memory_utilization, kv_cache.num_speculative_tokens, kv_cache.mamba_cache_mode,
        language_model_params(model), activated_params(model),
        shares, sum(s.bytes_total for s in shares), weight_per_gpu,
        reserve, reserve_total, used, pool, max_model_len, outside, left, layout,
        kv_token, kv_token / dcp, state_seq, state_seq / tp,
        tuple(request_footprint(layout, max_model_len, tp, d, pool) for d in _divisors(tp)),
        tuple(_concurrency_row(layout, c, dcp, pool) for c in contexts),
        tuple(decode_roofline(model, hardware, b, roofline_context_len, tp, dcp)
              for b in roofline_batch_sizes),
        model.assumptions + model.runtime_reserve + (draft.assumptions if draft else ())
        + hardware.assumptions
        + _plan_assumptions(model, tp, dcp, gpu_memory_utilization, kv_cache, layout,
                            roofline_context_len, roofline_batch_sizes),
    )


def _check_fits(layout: HybridKVLayout, pool: float, hbm_left: float, max_model_len: int,
                decode_context_parallel_size: int, outside: tuple[ReserveTerm, ...],
                gpu_memory_utilization: float) -> None:
    if hbm_left < 0:
        held = ", ".join(f"{t.name} {t.bytes_per_gpu / GB:.2f} GB" for t in outside)
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} leaves "
                         f"{(hbm_left + sum(t.bytes_per_gpu for t in outside)) / GB:.2f} GB of a "
                         f"GPU, and more is held beside it ({held}): lower "
                         f"gpu_memory_utilization by {-hbm_left / GB:.2f} GB of the GPU or more")
    needed = request_bytes_per_gpu(layout, max_model_len, decode_context_parallel_size)
    usable = max(0.0, pool - layout.bytes_per_block * NULL_BLOCKS)
    if needed > usable:
        # v1/core/kv_cache_utils.py _check_enough_kv_cache_memory, which stops the engine at start.
        raise ValueError(f"To serve at least one request with the model's max seq len "
                         f"({max_model_len}), {needed / GB:.2f} GB KV cache is needed per GPU, "
                         f"which is larger than the available KV cache memory "
                         f"({usable / GB:.2f} GB): vLLM would refuse to start; lower "
                         "max_model_len, raise gpu_memory_utilization or "
                         "decode_context_parallel_size")


def _concurrency_row(layout: HybridKVLayout, context_len: int, decode_context_parallel_size: int,
                     kv_pool_bytes_per_gpu: float) -> ConcurrencyRow:
    return ConcurrencyRow(
        context_len, request_bytes_per_gpu(layout, context_len, decode_context_parallel_size),
        max_concurrent_requests(layout, kv_pool_bytes_per_gpu, context_len,
                                decode_context_parallel_size))


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _validate(model: ModelSpec, hardware: HardwareSpec, tensor_parallel_size: int,
              decode_context_parallel_size: int, contexts: tuple[int, ...],
              gpu_memory_utilization: float, roofline_context_len: int) -> None:
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    if not 1 <= tp <= hardware.gpus_per_node:
        raise ValueError(f"tensor_parallel_size={tp}: must be 1..{hardware.gpus_per_node} "
                         f"(GPUs per {hardware.name} node); this planner covers one node")
    if dcp < 1 or tp % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp}: must divide "
                         f"tensor_parallel_size={tp} (DCP reuses the TP group's GPUs)")
    if model.kda_num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp}: must divide the model's "
                         f"{model.kda_num_heads} KDA heads")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: must be in (0, 1]")
    for context_len in (*contexts, roofline_context_len):
        if not 1 <= context_len <= model.max_context_len:
            raise ValueError(f"context {context_len}: must be 1..{model.max_context_len} "
                             f"(max_context_len of {model.name})")


def _plan_assumptions(model: ModelSpec, tensor_parallel_size: int,
                      decode_context_parallel_size: int, gpu_memory_utilization: float,
                      kv_cache: KVCacheSettings, layout: HybridKVLayout,
                      roofline_context_len: int,
                      roofline_batch_sizes: tuple[int, ...]) -> tuple[Assumption, ...]:
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    return (
        Assumption("gpu_memory_utilization", gpu_memory_utilization, "fraction of HBM",
                   "input: vLLM's gpu_memory_utilization (0.9 is vLLM's and EngineConfig's "
                   "default); HBM above it stays unused"),
        Assumption("num_speculative_tokens", kv_cache.num_speculative_tokens, "tokens",
                   "input: speculative_config.num_speculative_tokens; vLLM lengthens each KDA "
                   "conv state by k and keeps k extra KDA state pages per sequence"),
        Assumption("kda_pages_per_sequence", layout.kda_pages_per_sequence, "pages per group",
                   f"vllm: v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes, "
                   f"mamba_cache_mode={kv_cache.mamba_cache_mode!r} (prefix caching "
                   f"{'on' if kv_cache.enable_prefix_caching else 'off'})"),
        Assumption("kv_block_size", layout.block_size, "tokens",
                   "vllm: platforms/interface.py _align_hybrid_block_size, smallest multiple of "
                   "128 tokens whose MLA page holds one KDA state page"),
        Assumption("kv_layer_group_size", layout.group_size, "layers",
                   "vllm: v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size; "
                   f"{layout.kda_padding_layers + layout.mla_padding_layers} padding layers"),
        Assumption("kv_cache_copies_per_node", tp // dcp, "copies",
                   "derived: tensor_parallel_size / decode_context_parallel_size, because MLA has "
                   "one latent KV head, so every TP rank stores every token's latent + rope; DCP "
                   "splits tokens over its ranks. DCP does not shard weights, the runtime reserve "
                   "or the KDA state (per sequence, already split by TP heads)"),
        Assumption("roofline_context_len", roofline_context_len, "tokens",
                   "input: every sequence of a roofline batch is at this context, because one "
                   "context keeps the bound readable"),
        Assumption("kda_state_traffic_per_step", 2, "x state bytes",
                   "assumption: each KDA layer reads and writes a sequence's state once per "
                   "decode step, because the delta rule updates the state in place"),
        *(_routing_assumption(model, b) for b in roofline_batch_sizes),
    )


def _routing_assumption(model: ModelSpec, batch_size: int) -> Assumption:
    touched = expected_distinct_experts(model.num_experts, model.num_experts_per_token, batch_size)
    return Assumption(f"expected_distinct_experts_batch_{batch_size}", round(touched, 1),
                      "experts per MoE layer",
                      "assumption: uniform independent routing, E*(1-(1-k/E)^B), because the "
                      "real routing skew is unknown (skew touches fewer experts: a higher bound)")


_MEASURED_ROLES: dict[str, Role] = {"routed_experts": "routed_expert",
                                    "embed_tokens": "embedding_lookup", "vision": "vision"}


def with_checkpoint(model: ModelSpec, report: CheckpointReport) -> ModelSpec:
    """`model` with the weights check-checkpoint measured and its config's layer/expert counts.

    The weight groups become the report's (component, format, sharding) groups, with their bytes
    as stored and per GPU at the report's TP (MTP layers left out: vLLM's main model skips them).
    KV/state element sizes, the runtime reserve terms and the context length stay the model's. Raises
    ValueError unless the report is clean and came with a Kimi K3 config.json.
    """
    if not report.ok or report.model is None or report.bytes_per_rank is None:
        raise ValueError(f"{report.path}: needs a clean check with a Kimi K3 config.json; run "
                         f"`moonserve check-checkpoint {report.path}`")
    facts = dataclasses.asdict(report.model)
    if not facts["num_experts"]:
        raise ValueError(f"{report.path}: config.json has no routed experts; the planner models "
                         "a MoE model")
    groups = tuple(_measured_group(g, report.tensor_parallel_size) for g in report.groups
                   if g.sharding != "not loaded")
    return dataclasses.replace(model, name=f"{model.name} as measured in {report.path}",
                               param_groups=groups,
                               assumptions=_measured_assumptions(model, report, facts),
                               nominal_weight_inputs=(), **facts)


def _measured_group(g: GroupSummary, tensor_parallel_size: int) -> ParamGroup:
    role = _MEASURED_ROLES.get(g.component, "dense")
    return ParamGroup(g.component, g.num_params, g.format, role, g.sharding == "TP",
                      float(g.num_bytes), g.bytes_per_rank, tensor_parallel_size)


def _measured_assumptions(model: ModelSpec, report: CheckpointReport,
                          facts: dict[str, int]) -> tuple[Assumption, ...]:
    superseded = set(model.nominal_weight_inputs) | set(facts)
    units = {a.name: a.unit for a in model.assumptions}
    config_source = f"measured: {report.path} config.json (check-checkpoint)"
    measured = [Assumption(n, v, units.get(n, ""), config_source) for n, v in facts.items()]
    measured.append(Assumption(
        "checkpoint_weight_bytes_per_gpu", report.bytes_per_rank, "bytes",
        f"measured: {report.path} safetensors headers at TP={report.tensor_parallel_size}, "
        "vLLM's Kimi K3 TP rules (pipeline/capacity/kimi_k3_layout.py); bytes as stored, MTP layers "
        "excluded, so bf16 weights the engine re-quantizes to FP8 at load would take less"))
    return tuple(a for a in model.assumptions if a.name not in superseded) + tuple(measured)
