r"""`moonserve plan`'s output: a plan as readable tables, or as a JSON-ready dict.

Example:
    >>> from moonserve.pipeline.capacity.plan import plan
    >>> from moonserve.pipeline.capacity.registry import HARDWARE, MODELS
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"])
    >>> print(format_plan(p).split("\n\n")[2])  # the memory section
    HBM per GPU
                     GB
    weights          191.97
    runtime reserve  7.00
    used at start    198.97
    KV/state pool    60.23
    KV per token: 16,992 B (all layers, one copy); 16,992 B per GPU at DCP=1
    KDA state per sequence: 299.6 MB (one copy); 37.4 MB per GPU
    >>> plan_to_dict(p)["kv_bytes_per_token"]
    16992.0
"""

from __future__ import annotations

import dataclasses
import json

from moonserve.pipeline.capacity.plan import GB, Plan


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
