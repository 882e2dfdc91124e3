r"""`moonserve plan`'s output: a plan as readable tables, or as a JSON-ready dict.

Example:
    >>> from moonserve.pipeline.capacity.plan import plan
    >>> from moonserve.pipeline.capacity.registry import (BRIEF_USED_BYTES_PER_GPU_AT_START,
    ...     DRAFTS, HARDWARE, MODELS, k3_kv_cache_settings)
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"], draft=DRAFTS["kimi-k3-dspark"],
    ...          kv_cache=k3_kv_cache_settings())
    >>> b = compare_with_brief(p, BRIEF_USED_BYTES_PER_GPU_AT_START)
    >>> print(format_plan(p, b).split("\n\n")[3].split("what")[0])  # the brief section
    used per GPU at start       GB      source
    brief                       199.00  brief: ~199 GB/GPU used at start (8x MI355X, TP=8), not itemized
    derived                     196.31  used at start above
    residual (derived - brief)  -2.69
    <BLANKLINE>
    >>> plan_to_dict(p)["kv_bytes_per_token"]
    16704.0
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from moonserve.pipeline.capacity.plan import GB, Assumption, Plan


def plan_to_dict(p: Plan) -> dict:
    """JSON-serializable dict of the plan; tuples become lists, as JSON would read them back."""
    return json.loads(json.dumps(dataclasses.asdict(p)))


@dataclass(frozen=True)
class BriefComparison:
    """The brief's per-GPU figure beside the derived one; the residual is printed, not judged."""

    brief_bytes_per_gpu: float
    brief_source: str
    derived_bytes_per_gpu: float
    residual_bytes_per_gpu: float  # derived - brief
    explanation: tuple[str, ...]


def compare_with_brief(p: Plan, brief: Assumption) -> BriefComparison:
    """`p.used_bytes_per_gpu_at_start` beside the brief's figure, with what the residual holds."""
    by_role: dict[str, float] = {}
    for w in p.weights:
        by_role[w.role] = by_role.get(w.role, 0.0) + w.bytes_per_gpu
    target = p.weight_bytes_per_gpu - by_role.get("vision", 0.0) - by_role.get("draft", 0.0)
    residual = p.used_bytes_per_gpu_at_start - brief.value
    explanation = (
        f"target LM weights {_gb(target)} GB: the brief's figure leaves "
        f"{_gb(brief.value - target)} GB for everything else",
        f"in-engine ViT + projector {_gb(by_role.get('vision', 0.0))} GB (derived from vLLM's "
        "KimiK3VisionConfig defaults)",
        f"draft model {_gb(by_role.get('draft', 0.0))} GB"
        + (f" ({p.draft_name})" if p.draft_name else " (no draft planned)"),
        f"runtime reserve {_gb(p.runtime_reserve_bytes_per_gpu)} GB: assumptions, not "
        "measurements; the engine's start log ('Available KV cache memory') replaces them",
        "the brief does not itemize its ~199 GB, so the residual cannot be attributed further",
    )
    return BriefComparison(brief.value, brief.source, p.used_bytes_per_gpu_at_start, residual,
                           explanation)


def format_plan(p: Plan, brief: BriefComparison | None = None) -> str:
    """Readable tables of the plan, the brief comparison, and every assumption with its source."""
    sections = [
        f"moonserve plan: {p.model_name} on {p.hardware_name}, TP={p.tensor_parallel_size}, "
        f"DCP={p.decode_context_parallel_size}, gpu_memory_utilization={p.gpu_memory_utilization}"
        f", draft={p.draft_name or 'none'}, num_speculative_tokens={p.num_speculative_tokens}, "
        f"mamba_cache_mode={p.mamba_cache_mode}  (GB = 1e9 bytes)",
        _format_weights(p), _format_memory(p), *([_format_brief(brief)] if brief else []),
        _format_kv_layout(p), _format_requests(p), _format_concurrency(p), _format_roofline(p),
        _format_assumptions(p),
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
    rows = [("weights (target + ViT + draft)", _gb(p.weight_bytes_per_gpu), "table above")]
    rows += [(f"reserve: {r.name}", _gb(r.bytes_per_gpu), r.source) for r in p.runtime_reserve]
    rows += [("used at start (derived)", _gb(p.used_bytes_per_gpu_at_start), ""),
             ("KV/state pool", _gb(p.kv_pool_bytes_per_gpu),
              "gpu_memory_utilization * HBM - used at start")]
    rows += [(f"outside the pool: {t.name}", _gb(t.bytes_per_gpu), t.source)
             for t in p.outside_pool]
    rows += [("HBM left on the busiest GPU", _gb(p.hbm_left_bytes_per_gpu),
              "(1 - gpu_memory_utilization) * HBM - outside the pool")]
    per_token = (f"KV per token: {p.kv_bytes_per_token:,.0f} B (all MLA layers incl. draft, one "
                 f"copy, no indexer key); {p.kv_bytes_per_token_per_gpu:,.0f} B per GPU at "
                 f"DCP={p.decode_context_parallel_size}")
    per_seq = (f"KDA state per sequence, one page per layer: "
               f"{p.state_bytes_per_sequence / 1e6:,.1f} MB (one copy); "
               f"{p.state_bytes_per_sequence_per_gpu / 1e6:,.1f} MB per GPU")
    table = _table(("HBM per GPU", "GB", "source"), rows)
    return table + "\n" + per_token + "\n" + per_seq


def _format_brief(b: BriefComparison) -> str:
    rows = [("brief", _gb(b.brief_bytes_per_gpu), b.brief_source),
            ("derived", _gb(b.derived_bytes_per_gpu), "used at start above"),
            ("residual (derived - brief)", f"{b.residual_bytes_per_gpu / GB:+,.2f}", "")]
    lines = "\n".join(f"  - {e}" for e in b.explanation)
    return (_table(("used per GPU at start", "GB", "source"), rows)
            + "\nwhat the residual holds:\n" + lines)


def _format_kv_layout(p: Plan) -> str:
    k = p.kv_layout
    rows = [
        ("MLA bytes per token per layer", f"{k.mla_bytes_per_token_per_layer:,.0f}"),
        ("KDA state per layer per GPU", f"{k.kda_state_bytes_per_layer:,.0f}"),
        ("block size (tokens)", k.block_size),
        ("page per layer", f"{k.page_bytes:,.0f}"),
        ("KDA page padding", f"{k.kda_page_padding_bytes:,.0f}"),
        ("MLA layers (target + draft)", k.num_mla_layers),
        ("group size / MLA groups / KDA groups", f"{k.group_size} / {k.num_mla_groups} / "
                                                 f"{k.num_kda_groups}"),
        ("padding layers (MLA / KDA)", f"{k.mla_padding_layers} / {k.kda_padding_layers}"),
        ("bytes per block per GPU", f"{k.bytes_per_block:,.0f}"),
        ("KDA pages per sequence per group", k.kda_pages_per_sequence),
    ]
    title = ("KV cache layout per GPU (vLLM: platforms/interface.py _align_hybrid_block_size, "
             "v1/core/kv_cache_utils.py groups)")
    return title + "\n" + _table(("", "bytes / count"), rows)


def _format_requests(p: Plan) -> str:
    rows = [(r.decode_context_parallel_size, _gb(r.kv_bytes_per_gpu), _gb(r.state_bytes_per_gpu),
             _gb(r.bytes_per_gpu), _gb(r.bytes_per_node), "yes" if r.fits_on_one_node else "no")
            for r in p.max_context_requests]
    headers = ("DCP", "KV GB/GPU", "state GB/GPU", "GB/GPU", "GB/node", "fits")
    context_len = p.max_context_requests[0].context_len
    return (f"One {context_len:,}-token request (whole blocks)\n" + _table(headers, rows))


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
