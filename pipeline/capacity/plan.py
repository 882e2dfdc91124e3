"""Capacity planner behind `moonserve plan`: weights, KV/state, concurrency and a decode roofline.

Pure arithmetic over a `ModelSpec` and a `HardwareSpec`, for one node running one vLLM engine
with tensor parallelism (TP) and optional decode context parallelism (DCP). Every number the
product brief does not give is an `Assumption` with its source; `report.format_plan` prints them
all. The models and hardware it plans for are data in `registry` (Kimi K3.1 Pro, MI355X); nothing
here knows a particular model.

Units: bytes, bytes/s, seconds, tokens. GB = 1e9 bytes throughout.

Example:
    >>> from moonserve.pipeline.capacity.registry import HARDWARE, MODELS
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"])
    >>> round(p.used_bytes_per_gpu_at_start / 1e9)
    199
    >>> [(row.context_len, row.max_concurrent_requests) for row in p.concurrency]
    [(8192, 340), (131072, 26), (1048576, 3)]
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

# routed_expert: only the experts a batch routes to are read per decode step.
# dense: read in full every decode step. embedding_lookup: only the batch's rows are read.
# vision: loaded with the engine, not part of the language model's totals, not read in decode.
Role = Literal["routed_expert", "dense", "embedding_lookup", "vision"]

SOURCE_PREFIXES = ("brief", "vendor spec", "assumption:", "derived:", "input:", "measured:")


@dataclass(frozen=True)
class Assumption:
    """One input number and where it comes from.

    `source` starts with one of SOURCE_PREFIXES: "brief" (the product brief), "vendor spec",
    "assumption: <what> because <why>", "derived: <formula>", "input: <who sets it>" or
    "measured: <which checkpoint>" (`moonserve plan --checkpoint`).
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
    qk_rope_head_dim: int  # MLA decoupled rope key elements per token per layer
    kv_cache_bytes_per_element: float
    index_topk: int  # history tokens the sparse indexer selects per query
    indexer_key_bytes_per_layer: float  # per token, key + its scale
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_kernel_size: int
    kda_recurrent_state_bytes_per_element: float
    kda_conv_state_bytes_per_element: float
    max_context_len: int
    runtime_reserve_bytes_per_gpu: float  # activations, workspaces, graph pools, comm buffers
    assumptions: tuple[Assumption, ...]
    nominal_weight_inputs: tuple[str, ...] = ()


# ModelSpec fields that are not one number; every other field has a same-named Assumption.
NON_SCALAR_FIELDS = ("name", "param_groups", "assumptions", "nominal_weight_inputs")


def scalar_field_names() -> tuple[str, ...]:
    """ModelSpec's one-number fields (layer counts, geometry, element sizes, reserve)."""
    return tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name not in NON_SCALAR_FIELDS)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    gpus_per_node: int
    hbm_bytes_per_gpu: float
    hbm_bandwidth_bytes_per_s: float  # per GPU
    assumptions: tuple[Assumption, ...]


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
    """HBM one request of `context_len` tokens holds, at one DCP size."""

    context_len: int
    decode_context_parallel_size: int
    kv_bytes_per_gpu: float  # MLA latent + rope + indexer keys
    state_bytes_per_gpu: float  # KDA recurrent + conv state
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
class Plan:
    model_name: str
    hardware_name: str
    tensor_parallel_size: int
    decode_context_parallel_size: int
    gpu_memory_utilization: float
    total_params: int  # language model, vision encoder excluded
    activated_params: float  # per token
    weights: tuple[WeightShare, ...]
    weight_bytes_total: float
    weight_bytes_per_gpu: float
    runtime_reserve_bytes_per_gpu: float
    used_bytes_per_gpu_at_start: float  # weights + runtime reserve, before KV
    kv_pool_bytes_per_gpu: float  # for KV cache and KDA state
    kv_bytes_per_token: float  # one copy, all layers
    kv_bytes_per_token_per_gpu: float
    state_bytes_per_sequence: float  # one copy, all KDA layers
    state_bytes_per_sequence_per_gpu: float
    max_context_requests: tuple[RequestFootprint, ...]  # one per DCP size dividing TP
    concurrency: tuple[ConcurrencyRow, ...]
    roofline: tuple[DecodeRoofline, ...]
    assumptions: tuple[Assumption, ...]


def weight_shares(model: ModelSpec, tensor_parallel_size: int) -> tuple[WeightShare, ...]:
    return tuple(_weight_share(g, tensor_parallel_size) for g in model.param_groups)


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
    return sum(g.num_params for g in model.param_groups if g.role != "vision")


def activated_params(model: ModelSpec) -> float:
    """Parameters one token uses: every non-expert weight + k of E routed experts."""
    routed = sum(g.num_params for g in model.param_groups if g.role == "routed_expert")
    active_fraction = model.num_experts_per_token / model.num_experts
    return language_model_params(model) - routed + routed * active_fraction


def kv_bytes_per_token(model: ModelSpec) -> float:
    """One copy of a token's cache over all MLA layers: latent + rope key + indexer key."""
    mla = (model.kv_lora_rank + model.qk_rope_head_dim) * model.kv_cache_bytes_per_element
    return model.num_mla_layers * (mla + model.indexer_key_bytes_per_layer)


def state_bytes_per_sequence(model: ModelSpec) -> float:
    """One copy of a sequence's KDA state over all KDA layers, independent of its length."""
    heads, dim = model.kda_num_heads, model.kda_head_dim
    recurrent = heads * dim * dim * model.kda_recurrent_state_bytes_per_element  # [H, K, V]
    conv_channels = 3 * heads * dim  # short convs on q, k, v
    conv = conv_channels * (model.kda_conv_kernel_size - 1) * model.kda_conv_state_bytes_per_element
    return model.num_kda_layers * (recurrent + conv)


def kv_bytes_per_token_per_gpu(model: ModelSpec, decode_context_parallel_size: int) -> float:
    # MLA has a single latent KV head, so every TP rank keeps every token; DCP splits the tokens.
    return kv_bytes_per_token(model) / decode_context_parallel_size


def state_bytes_per_sequence_per_gpu(model: ModelSpec, tensor_parallel_size: int) -> float:
    return state_bytes_per_sequence(model) / tensor_parallel_size  # KDA heads split over TP


def request_bytes_per_gpu(model: ModelSpec, context_len: int, tensor_parallel_size: int,
                          decode_context_parallel_size: int) -> float:
    kv = context_len * kv_bytes_per_token_per_gpu(model, decode_context_parallel_size)
    return kv + state_bytes_per_sequence_per_gpu(model, tensor_parallel_size)


def request_footprint(model: ModelSpec, context_len: int, tensor_parallel_size: int,
                      decode_context_parallel_size: int,
                      kv_pool_bytes_per_gpu: float) -> RequestFootprint:
    kv = context_len * kv_bytes_per_token_per_gpu(model, decode_context_parallel_size)
    state = state_bytes_per_sequence_per_gpu(model, tensor_parallel_size)
    return RequestFootprint(context_len, decode_context_parallel_size, kv, state, kv + state,
                            (kv + state) * tensor_parallel_size,
                            kv + state <= kv_pool_bytes_per_gpu)


def max_concurrent_requests(kv_pool_bytes_per_gpu: float, bytes_per_request_per_gpu: float) -> int:
    return max(0, math.floor(kv_pool_bytes_per_gpu / bytes_per_request_per_gpu))


def expected_distinct_experts(num_experts: int, num_experts_per_token: int,
                              batch_size: int) -> float:
    """Experts per MoE layer a batch touches under uniform independent routing: E(1-(1-k/E)^B)."""
    return num_experts * (1 - (1 - num_experts_per_token / num_experts) ** batch_size)


def decode_weight_bytes_per_gpu(model: ModelSpec, tensor_parallel_size: int,
                                batch_size: int) -> float:
    touched = expected_distinct_experts(model.num_experts, model.num_experts_per_token, batch_size)
    read_fraction = {"routed_expert": touched / model.num_experts, "dense": 1.0,
                     "embedding_lookup": 0.0, "vision": 0.0}
    shares = weight_shares(model, tensor_parallel_size)
    return sum(s.bytes_per_gpu * read_fraction[s.role] for s in shares)


def decode_kv_state_bytes_per_gpu(model: ModelSpec, context_len: int, tensor_parallel_size: int,
                                  decode_context_parallel_size: int) -> float:
    """Cache bytes one sequence's decode step reads on one GPU.

    Per MLA layer: the indexer scans every cached indexer key, then attention reads the latent +
    rope of the `index_topk` selected tokens; DCP ranks each do 1/DCP of both. KDA reads and
    writes its state once (2x).
    """
    latent = (model.kv_lora_rank + model.qk_rope_head_dim) * model.kv_cache_bytes_per_element
    selected = min(context_len, model.index_topk) * latent
    scanned = context_len * model.indexer_key_bytes_per_layer
    mla = model.num_mla_layers * (selected + scanned) / decode_context_parallel_size
    return mla + 2 * state_bytes_per_sequence_per_gpu(model, tensor_parallel_size)


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


def plan(model: ModelSpec, hardware: HardwareSpec, tensor_parallel_size: int = 8,
         decode_context_parallel_size: int = 1,
         contexts: tuple[int, ...] = (8192, 131072, 1048576), *,
         gpu_memory_utilization: float = 0.9, roofline_context_len: int = 8192,
         roofline_batch_sizes: tuple[int, ...] = (1, 64)) -> Plan:
    """Capacity of one engine with `tensor_parallel_size` GPUs of one node.

    `gpu_memory_utilization` is vLLM's: the engine may use that fraction of each GPU's HBM.
    Concurrency is at `decode_context_parallel_size`; `max_context_requests` shows one
    `model.max_context_len`-token request at every DCP size dividing TP. Raises ValueError on a
    layout vLLM would refuse. Example: see the module docstring.
    """
    _validate(model, hardware, tensor_parallel_size, decode_context_parallel_size, contexts,
              gpu_memory_utilization, roofline_context_len)
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    shares = weight_shares(model, tp)
    weight_per_gpu = sum(s.bytes_per_gpu for s in shares)
    used = weight_per_gpu + model.runtime_reserve_bytes_per_gpu
    pool = gpu_memory_utilization * hardware.hbm_bytes_per_gpu - used
    return Plan(
        model.name, hardware.name, tp, dcp, gpu_memory_utilization,
        language_model_params(model), activated_params(model),
        shares, sum(s.bytes_total for s in shares), weight_per_gpu,
        model.runtime_reserve_bytes_per_gpu, used, pool,
        kv_bytes_per_token(model), kv_bytes_per_token_per_gpu(model, dcp),
        state_bytes_per_sequence(model), state_bytes_per_sequence_per_gpu(model, tp),
        tuple(request_footprint(model, model.max_context_len, tp, d, pool) for d in _divisors(tp)),
        tuple(_concurrency_row(model, c, tp, dcp, pool) for c in contexts),
        tuple(decode_roofline(model, hardware, b, roofline_context_len, tp, dcp)
              for b in roofline_batch_sizes),
        model.assumptions + hardware.assumptions
        + _plan_assumptions(model, tp, dcp, gpu_memory_utilization, roofline_context_len,
                            roofline_batch_sizes),
    )


def _concurrency_row(model: ModelSpec, context_len: int, tensor_parallel_size: int,
                     decode_context_parallel_size: int,
                     kv_pool_bytes_per_gpu: float) -> ConcurrencyRow:
    per_request = request_bytes_per_gpu(model, context_len, tensor_parallel_size,
                                        decode_context_parallel_size)
    return ConcurrencyRow(context_len, per_request,
                          max_concurrent_requests(kv_pool_bytes_per_gpu, per_request))


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
                      roofline_context_len: int,
                      roofline_batch_sizes: tuple[int, ...]) -> tuple[Assumption, ...]:
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    return (
        Assumption("gpu_memory_utilization", gpu_memory_utilization, "fraction of HBM",
                   "input: vLLM's gpu_memory_utilization (0.9 is vLLM's and EngineConfig's "
                   "default); HBM above it stays unused"),
        Assumption("kv_cache_copies_per_node", tp // dcp, "copies",
                   "derived: tensor_parallel_size / decode_context_parallel_size, because MLA has "
                   "one latent KV head, so every TP rank stores every token's latent + rope and "
                   "indexer key; DCP splits tokens over its ranks. DCP does not shard weights, "
                   "the runtime reserve or the KDA state (per sequence, already split by TP "
                   "heads)"),
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
    KV/state element sizes, the runtime reserve and the context length stay the model's. Raises
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
