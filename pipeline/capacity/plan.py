"""Capacity planner behind `moonserve plan`: weights, KV/state, concurrency and a decode roofline.

Pure arithmetic over a `ModelSpec` and a `HardwareSpec`, for one node running one vLLM engine
with tensor parallelism (TP) and optional decode context parallelism (DCP). Every number the
product brief does not give is an `Assumption` with its source; `format_plan` prints them all.

Units: bytes, bytes/s, seconds, tokens. GB = 1e9 bytes throughout.

Example:
    >>> from moonserve.pipeline.capacity.plan import HARDWARE, MODELS, check_against_brief, plan
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"])
    >>> round(p.used_bytes_per_gpu_at_start / 1e9)
    199
    >>> check_against_brief(p)
    []
    >>> [(row.context_len, row.max_concurrent_requests) for row in p.concurrency]
    [(8192, 340), (131072, 26), (1048576, 3)]
"""

from __future__ import annotations

import dataclasses
import json
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
    """What the planner needs to know about a model; every scalar has a same-named Assumption."""

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


# ---- weights ----------------------------------------------------------------------------------


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


# ---- KV cache and KDA state --------------------------------------------------------------------


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


# ---- decode roofline ---------------------------------------------------------------------------


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


# ---- the plan ----------------------------------------------------------------------------------


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


# ---- measured weights (moonserve plan --checkpoint) --------------------------------------------

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
                               assumptions=_measured_assumptions(model, report, facts), **facts)


def _measured_group(g: GroupSummary, tensor_parallel_size: int) -> ParamGroup:
    role = _MEASURED_ROLES.get(g.component, "dense")
    return ParamGroup(g.component, g.num_params, g.format, role, g.sharding == "TP",
                      float(g.num_bytes), g.bytes_per_rank, tensor_parallel_size)


def _nominal_weight_inputs(model: ModelSpec) -> set[str]:
    """Assumptions that only fed the nominal parameter counts."""
    return ({a.name for a in _kimi_k3_geometry()} | {f"{g.name}_params" for g in model.param_groups}
            | {"total_params", "activated_params", "vision_encoder_params", "mxfp4_bytes_per_param",
               "fp8_bytes_per_param", "bf16_bytes_per_param"})


def _measured_assumptions(model: ModelSpec, report: CheckpointReport,
                          facts: dict[str, int]) -> tuple[Assumption, ...]:
    superseded = _nominal_weight_inputs(model) | set(facts)
    units = {a.name: a.unit for a in model.assumptions}
    config_source = f"measured: {report.path} config.json (check-checkpoint)"
    measured = [Assumption(n, v, units.get(n, ""), config_source) for n, v in facts.items()]
    measured.append(Assumption(
        "checkpoint_weight_bytes_per_gpu", report.bytes_per_rank, "bytes",
        f"measured: {report.path} safetensors headers at TP={report.tensor_parallel_size}, "
        "vLLM's Kimi K3 TP rules (pipeline/capacity/kimi_k3_layout.py); bytes as stored, MTP layers "
        "excluded, so bf16 weights the engine re-quantizes to FP8 at load would take less"))
    return tuple(a for a in model.assumptions if a.name not in superseded) + tuple(measured)


# ---- the brief ---------------------------------------------------------------------------------

BRIEF_TOTAL_PARAMS = 2.8e12
BRIEF_ACTIVATED_PARAMS = 104e9
BRIEF_USED_BYTES_PER_GPU_AT_START = 199 * GB
BRIEF_LONG_REQUEST_LEN = 1_048_576
BRIEF_TOLERANCE = 0.05


def check_against_brief(p: Plan) -> list[str]:
    """Violations of the product brief's numbers (±5%); empty when the plan reproduces them."""
    violations = [
        _off_by_more_than_tolerance("total params", p.total_params, BRIEF_TOTAL_PARAMS),
        _off_by_more_than_tolerance("activated params", p.activated_params, BRIEF_ACTIVATED_PARAMS),
        _off_by_more_than_tolerance("used bytes per GPU at start", p.used_bytes_per_gpu_at_start,
                                    BRIEF_USED_BYTES_PER_GPU_AT_START),
        _long_request_violation(p),
    ]
    return [v for v in violations if v]


def _off_by_more_than_tolerance(what: str, value: float, target: float) -> str:
    if abs(value / target - 1) <= BRIEF_TOLERANCE:
        return ""
    return (f"{what}: {value / GB:,.2f}e9 is not within ±{BRIEF_TOLERANCE:.0%} of the brief's "
            f"{target / GB:,.2f}e9")


def _long_request_violation(p: Plan) -> str:
    # The brief claims the fit without DCP: "~199 GB/GPU used at start, so one 1M request fits".
    rows = [r for r in p.max_context_requests
            if r.context_len == BRIEF_LONG_REQUEST_LEN and r.decode_context_parallel_size == 1]
    if not rows:
        return f"no {BRIEF_LONG_REQUEST_LEN:,}-token request in the plan (max_context_len differs)"
    if rows[0].fits_on_one_node:
        return ""
    return (f"one {BRIEF_LONG_REQUEST_LEN:,}-token request needs {rows[0].bytes_per_gpu / GB:.2f} "
            f"GB per GPU without DCP; the KV/state pool is {p.kv_pool_bytes_per_gpu / GB:.2f} GB")


# ---- output ------------------------------------------------------------------------------------


def plan_to_dict(p: Plan) -> dict:
    """JSON-serializable dict of the plan; tuples become lists, as JSON would read them back."""
    return json.loads(json.dumps(dataclasses.asdict(p)))


def format_plan(p: Plan) -> str:
    """Readable tables of the plan, ending with every assumption and its source."""
    sections = [
        f"moonserve plan: {p.model_name} on {p.hardware_name}, TP={p.tensor_parallel_size}, "
        f"DCP={p.decode_context_parallel_size}, gpu_memory_utilization={p.gpu_memory_utilization}"
        f"  (GB = 1e9 bytes)",
        _format_weights(p), _format_memory(p), _format_requests(p),
        _format_concurrency(p), _format_roofline(p), _format_assumptions(p),
    ]
    return "\n\n".join(sections) + "\n"


def _table(headers: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in row) for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:,.2f}"


def _format_weights(p: Plan) -> str:
    rows = [(s.name, s.dtype, f"{s.num_params / 1e9:,.3f}B", _gb(s.bytes_total),
             _gb(s.bytes_per_gpu), "TP" if s.tp_sharded else "replicated") for s in p.weights]
    rows.append(("total", "", f"{sum(s.num_params for s in p.weights) / 1e9:,.3f}B",
                 _gb(p.weight_bytes_total), _gb(p.weight_bytes_per_gpu), ""))
    title = (f"Weights (language model {p.total_params / 1e12:.3f}T total, "
             f"{p.activated_params / 1e9:.1f}B activated per token)")
    headers = ("component", "dtype", "params", "GB total", "GB per GPU", "sharding")
    return title + "\n" + _table(headers, rows)


def _format_memory(p: Plan) -> str:
    rows = [
        ("weights", _gb(p.weight_bytes_per_gpu)),
        ("runtime reserve", _gb(p.runtime_reserve_bytes_per_gpu)),
        ("used at start", _gb(p.used_bytes_per_gpu_at_start)),
        ("KV/state pool", _gb(p.kv_pool_bytes_per_gpu)),
    ]
    per_token = (f"KV per token: {p.kv_bytes_per_token:,.0f} B (all layers, one copy); "
                 f"{p.kv_bytes_per_token_per_gpu:,.0f} B per GPU at "
                 f"DCP={p.decode_context_parallel_size}")
    per_seq = (f"KDA state per sequence: {p.state_bytes_per_sequence / 1e6:,.1f} MB (one copy); "
               f"{p.state_bytes_per_sequence_per_gpu / 1e6:,.1f} MB per GPU")
    return "HBM per GPU\n" + _table(("", "GB"), rows) + "\n" + per_token + "\n" + per_seq


def _format_requests(p: Plan) -> str:
    rows = [(r.decode_context_parallel_size, _gb(r.kv_bytes_per_gpu), _gb(r.state_bytes_per_gpu),
             _gb(r.bytes_per_gpu), _gb(r.bytes_per_node), "yes" if r.fits_on_one_node else "no")
            for r in p.max_context_requests]
    headers = ("DCP", "KV GB/GPU", "state GB/GPU", "GB/GPU", "GB/node", "fits")
    context_len = p.max_context_requests[0].context_len
    return f"One {context_len:,}-token request\n" + _table(headers, rows)


def _format_concurrency(p: Plan) -> str:
    rows = [(f"{r.context_len:,}", _gb(r.bytes_per_request_per_gpu), r.max_concurrent_requests)
            for r in p.concurrency]
    title = f"Concurrent requests that fit (memory bound, DCP={p.decode_context_parallel_size})"
    return title + "\n" + _table(("context", "GB/GPU per request", "requests"), rows)


def _format_roofline(p: Plan) -> str:
    rows = [(r.batch_size, f"{r.context_len:,}", f"{r.expected_distinct_experts:.1f}",
             _gb(r.weight_bytes_per_gpu), _gb(r.kv_state_bytes_per_gpu),
             f"{r.step_time_s * 1e3:.3f}", f"{r.tokens_per_s:,.0f}") for r in p.roofline]
    bandwidth = p.roofline[0].aggregate_bandwidth_bytes_per_s / 1e12 if p.roofline else 0.0
    title = f"Decode roofline (HBM-bound upper bound, aggregate {bandwidth:.1f} TB/s)"
    headers = ("batch", "context", "experts/layer", "weights GB/GPU", "KV+state GB/GPU",
               "step ms", "tok/s")
    return title + "\n" + _table(headers, rows)


def _format_assumptions(p: Plan) -> str:
    rows = [(a.name, _format_value(a.value), a.unit, a.source) for a in p.assumptions]
    return "Inputs and assumptions\n" + _table(("name", "value", "unit", "source"), rows)


def _format_value(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,}"


# ---- registries --------------------------------------------------------------------------------

def _kimi_k3_geometry() -> tuple[Assumption, ...]:
    """Numbers the brief does not give; they shape parameter counts and cache sizes."""
    k2_mla = ("assumption: Kimi K2 / DeepSeek-V3 MLA geometry, because the brief gives only "
              "latent 512 + rope 64")
    v32_indexer = ("assumption: DeepSeek-V3.2 sparse indexer geometry (same 2,048-token top-k), "
                   "because the brief gives no indexer geometry")
    return (
        Assumption("hidden_size", 7168, "elements",
                   "assumption: Kimi K2's hidden size, because K3 keeps K2's MLA latent geometry "
                   "(512 + 64, from the brief) and the brief gives no hidden size"),
        Assumption("vocab_size", 163840, "tokens",
                   "assumption: the Kimi tokenizer's vocabulary (Kimi K2; vLLM KimiLinearConfig "
                   "default; K3's media placeholder id 163605 lies inside it), because the brief "
                   "gives none"),
        Assumption("num_dense_layers", 1, "layers",
                   "assumption: first layer has a dense MLP, the other 92 are MoE (K2's "
                   "first_k_dense_replace=1), because the brief gives none"),
        Assumption("mla_num_heads", 64, "heads", k2_mla),
        Assumption("q_lora_rank", 1536, "elements", k2_mla),
        Assumption("qk_nope_head_dim", 128, "elements", k2_mla),
        Assumption("v_head_dim", 128, "elements", k2_mla),
        Assumption("indexer_num_heads", 64, "heads", v32_indexer),
        Assumption("indexer_head_dim", 128, "elements", v32_indexer),
    )


def _kimi_k3_cache_facts() -> tuple[Assumption, ...]:
    return (
        Assumption("num_kda_layers", 69, "layers", "brief"),
        Assumption("num_mla_layers", 24, "layers", "brief"),
        Assumption("kv_lora_rank", 512, "elements", "brief: MLA latent per token per layer"),
        Assumption("qk_rope_head_dim", 64, "elements", "brief: MLA rope key per token per layer"),
        Assumption("kv_cache_bytes_per_element", 1.0, "bytes", "brief: FP8 KV cache"),
        Assumption("index_topk", 2048, "tokens", "brief: history tokens selected per query"),
        Assumption("indexer_key_bytes_per_layer", 128 + 128 // 128 * 4, "bytes per token",
                   "assumption: 128 FP8 key values + one fp32 scale per 128 (vLLM's sparse-"
                   "indexer cache layout), because the brief gives no indexer key size"),
        Assumption("kda_num_heads", 64, "heads",
                   "assumption: 64 heads x 128 (the MLA head count at Kimi Linear's head_dim), "
                   "because the brief gives no KDA geometry"),
        Assumption("kda_head_dim", 128, "elements",
                   "assumption: Kimi Linear's KDA head_dim, because the brief gives none"),
        Assumption("kda_conv_kernel_size", 4, "taps",
                   "assumption: Kimi Linear's short_conv_kernel_size, because the brief gives "
                   "none"),
        Assumption("kda_recurrent_state_bytes_per_element", 4.0, "bytes",
                   "assumption: fp32 recurrent state (vLLM's KDA default with "
                   "mamba_ssm_cache_dtype=auto), because the brief gives no state dtype"),
        Assumption("kda_conv_state_bytes_per_element", 2.0, "bytes",
                   "assumption: conv state in bf16 (vLLM mamba_cache_dtype=auto follows the model "
                   "dtype), because the brief gives no state dtype"),
        Assumption("max_context_len", 1_048_576, "tokens", "brief: 1M-token context window"),
    )


def _kimi_k3_moe_and_dtypes() -> tuple[Assumption, ...]:
    return (
        Assumption("total_params", 2.8e12, "params", "brief"),
        Assumption("activated_params", 104e9, "params", "brief"),
        Assumption("num_experts", 896, "experts", "brief"),
        Assumption("num_experts_per_token", 16, "experts", "brief"),
        Assumption("mxfp4_bytes_per_param", DTYPE_BYTES["mxfp4"], "bytes",
                   "brief: MXFP4 routed experts, 4-bit E2M1 + one E8M0 scale byte per 32"),
        Assumption("fp8_bytes_per_param", DTYPE_BYTES["fp8"], "bytes",
                   "brief: FP8 re-quantized attention and dense layers"),
        Assumption("bf16_bytes_per_param", DTYPE_BYTES["bf16"], "bytes",
                   "brief: bf16 embeddings, LM head and vision encoder"),
        Assumption("vision_encoder_params", 401_000_000, "params", "brief: MoonViT-V2"),
        Assumption("runtime_reserve_bytes_per_gpu", 7 * GB, "bytes",
                   "assumption: ~4 GB activation + MoE workspace peak at 8,192 batched tokens, "
                   "~2 GB HIP graph pools, ~1 GB RCCL buffers and HIP context, because vLLM "
                   "measures it only at startup; with the weights above it reproduces the "
                   "brief's ~199 GB/GPU at start"),
    )


def _kimi_k3_param_counts(v: dict[str, float]) -> dict[str, int]:
    """Parameters per component; the routed experts are solved from the brief's two totals."""
    h, vocab = int(v["hidden_size"]), int(v["vocab_size"])
    num_moe_layers = int(v["num_mla_layers"] + v["num_kda_layers"] - v["num_dense_layers"])
    # N + R = total and N + R*k/E = activated  =>  R = (total - activated) * E / (E - k)
    experts, k = v["num_experts"], v["num_experts_per_token"]
    routed = round((v["total_params"] - v["activated_params"]) * experts / (experts - k))
    counts = {
        "routed_experts": routed,
        "embed_tokens": vocab * h,
        "lm_head": vocab * h,
        "moe_router": h * int(experts) * num_moe_layers,
        "attention_tp_sharded": _attention_sharded_params(v),
        "attention_replicated": int(v["num_mla_layers"]) * _mla_replicated_params_per_layer(v),
    }
    counts["dense_mlp"] = int(v["total_params"]) - sum(counts.values())
    return counts


def _mla_sharded_params_per_layer(v: dict[str, float]) -> int:
    heads, h = int(v["mla_num_heads"]), int(v["hidden_size"])
    q_b = int(v["q_lora_rank"]) * heads * int(v["qk_nope_head_dim"] + v["qk_rope_head_dim"])
    kv_b = int(v["kv_lora_rank"]) * heads * int(v["qk_nope_head_dim"] + v["v_head_dim"])
    o = heads * int(v["v_head_dim"]) * h
    return q_b + kv_b + o


def _mla_replicated_params_per_layer(v: dict[str, float]) -> int:
    # vLLM keeps q_a, kv_a and the indexer's wq_b / wk / weights_proj unsharded on every rank.
    h, q_lora = int(v["hidden_size"]), int(v["q_lora_rank"])
    q_a = h * q_lora
    kv_a = h * int(v["kv_lora_rank"] + v["qk_rope_head_dim"])
    indexer_dim = int(v["indexer_num_heads"] * v["indexer_head_dim"])
    indexer = q_lora * indexer_dim + h * int(v["indexer_head_dim"] + v["indexer_num_heads"])
    return q_a + kv_a + indexer


def _kda_params_per_layer(v: dict[str, float]) -> int:
    h, heads, dim = int(v["hidden_size"]), int(v["kda_num_heads"]), int(v["kda_head_dim"])
    proj = heads * dim
    in_proj = h * (4 * proj + dim + heads)  # q, k, v, output gate g, low-rank f_a, beta
    f_b = dim * proj
    conv = 3 * proj * int(v["kda_conv_kernel_size"])
    o = proj * h
    return in_proj + f_b + conv + o


def _attention_sharded_params(v: dict[str, float]) -> int:
    mla = int(v["num_mla_layers"]) * _mla_sharded_params_per_layer(v)
    return mla + int(v["num_kda_layers"]) * _kda_params_per_layer(v)


_K3_GROUP_LAYOUT: dict[str, tuple[str, Role, bool, str]] = {
    # name: (dtype, role, tp_sharded, source of its parameter count)
    "routed_experts": ("mxfp4", "routed_expert", True,
                       "brief: solved from 2.8T total and 104B activated with 16 of 896 experts "
                       "active, (total - activated) * 896 / 880"),
    "embed_tokens": ("bf16", "embedding_lookup", True, "derived: vocab_size * hidden_size"),
    "lm_head": ("bf16", "dense", True,
                "assumption: untied LM head (vocab_size * hidden_size) as in Kimi K2, because "
                "the brief gives none"),
    "moe_router": ("bf16", "dense", False,
                   "assumption: hidden_size * 896 gate per MoE layer, bf16 and replicated on every "
                   "TP rank (vLLM's GateLinear is neither sharded nor FP8), because the brief "
                   "gives no router dtype"),
    "attention_tp_sharded": ("fp8", "dense", True,
                             "derived: MLA q_b + kv_b + o and KDA in-proj (q, k, v, g, f_a, beta) "
                             "+ f_b + conv + o per layer from the assumed geometry"),
    "attention_replicated": ("fp8", "dense", False,
                             "derived: MLA q_a + kv_a + indexer wq_b, wk, weights_proj per layer, "
                             "which vLLM replicates on every TP rank"),
    "dense_mlp": ("fp8", "dense", True,
                  "assumption: the rest of the 2.8T after the groups above is shared experts + "
                  "the dense layer's MLP, because the brief fixes only the totals (moving params "
                  "between it and attention changes no bytes: both FP8, both TP-sharded)"),
}


def _kimi_k3_param_groups(
        v: dict[str, float]) -> tuple[tuple[ParamGroup, ...], tuple[Assumption, ...]]:
    counts = _kimi_k3_param_counts(v)
    groups = [ParamGroup(n, counts[n], dtype, role, sharded)
              for n, (dtype, role, sharded, _) in _K3_GROUP_LAYOUT.items()]
    # 12 ViT heads do not divide TP=8, so vLLM falls back to a data-parallel (replicated) ViT.
    groups.append(ParamGroup("vision_encoder", int(v["vision_encoder_params"]), "bf16", "vision",
                             False))
    records = [Assumption(f"{n}_params", counts[n], "params", layout[3])
               for n, layout in _K3_GROUP_LAYOUT.items()]
    return tuple(groups), tuple(records)


def _kimi_k3_1_pro() -> ModelSpec:
    assumptions = _kimi_k3_moe_and_dtypes() + _kimi_k3_cache_facts() + _kimi_k3_geometry()
    v = {a.name: a.value for a in assumptions}
    groups, group_records = _kimi_k3_param_groups(v)
    scalars = {f.name: v[f.name] for f in dataclasses.fields(ModelSpec)
               if f.name not in ("name", "param_groups", "assumptions")}
    return ModelSpec(name="kimi-k3.1-pro", param_groups=groups,
                     assumptions=assumptions + group_records, **scalars)


def _mi355x() -> HardwareSpec:
    return HardwareSpec(
        name="mi355x", gpus_per_node=8, hbm_bytes_per_gpu=288 * GB,
        hbm_bandwidth_bytes_per_s=8e12,
        assumptions=(
            Assumption("gpus_per_node", 8, "GPUs", "brief"),
            Assumption("hbm_bytes_per_gpu", 288 * GB, "bytes",
                       "brief: 288 GB HBM3E, read as 1e9-byte GB because the brief's ~199 GB is "
                       "read the same way (the stacks may hold 288 GiB = 309e9 bytes, so this "
                       "errs low)"),
            Assumption("hbm_bandwidth_bytes_per_s", 8e12, "bytes/s per GPU",
                       "vendor spec: AMD Instinct MI355X, 8 TB/s HBM3E peak"),
        ),
    )


MODELS: dict[str, ModelSpec] = {"kimi-k3.1-pro": _kimi_k3_1_pro()}
HARDWARE: dict[str, HardwareSpec] = {"mi355x": _mi355x()}
