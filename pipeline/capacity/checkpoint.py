"""`moonserve check-checkpoint`: preflight a safetensors checkpoint from its headers alone.

Reads each file's header through safetensors' safe_open (`moonserve.pipeline.models.weights`:
dtypes and shapes, never tensor data), so a 1.5 TB checkpoint takes seconds. Pairs quantized
weights with their scales (the MXFP4 rule is `moonserve.kernels.mxfp4.format`'s), checks every tensor
vLLM's Kimi K3 loader expects for the checkpoint's config.json (`pipeline/capacity/kimi_k3_layout.py` says
where each name, shape and TP rule comes from), and sums parameters and bytes by component,
storage format and per tensor-parallel rank. `moonserve plan --checkpoint` plans with these measured bytes.

Storage formats:
* `mxfp4`: 32 E2M1 codes in 16 uint8 bytes per block, one E8M0 scale (uint8) per block; stored as
  gpt-oss's `X_blocks [..., G, 16]` + `X_scales [..., G]`, or compressed-tensors'
  `X.weight_packed [..., G * 16]` + `X.weight_scale [..., G]` (what vLLM's Kimi K3 loader reads).
  Logical K = G * 32; a packed byte counts as 2 parameters; scales count bytes, not parameters.
* `fp8` / `int8`: `X.weight` in F8_E4M3/F8_E5M2/I8 with `X.weight_scale` or `X.weight_scale_inv`
  (and optional `X.input_scale`).
* otherwise the dtype: `bf16`, `fp16`, `fp32`, ...

Example:
    >>> report = check_checkpoint("/models/Kimi-K3.1-Pro", tensor_parallel_size=8)  # doctest: +SKIP
    >>> report.ok, round(report.bytes_per_rank / 1e9)  # doctest: +SKIP
    (True, 192)
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from moonserve.kernels.mxfp4.format import (
    BLOCK_BYTES,
    BLOCKS_SUFFIX,
    SCALES_DTYPES,
    SCALES_SUFFIX,
    dtypes_fit,
    packed_layout,
)
from moonserve.pipeline.capacity.kimi_k3_layout import (
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    ExpectedTensor,
    KimiCheckpointConfig,
    ModelFacts,
    expected_tensors,
    is_mtp_name,
    normalize_name,
)
from moonserve.pipeline.config import dspark_draft_kind
from moonserve.pipeline.models.weights import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointFiles,
    HeaderError,
    Problem,
    TensorHeader,
    locate_files,
    read_safetensors_header,
)

FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
SCALED_WEIGHT_FORMATS = {"F8_E4M3": "fp8", "F8_E5M2": "fp8", "F8_E4M3FNUZ": "fp8",
                         "F8_E5M2FNUZ": "fp8", "I8": "int8"}
# Suffix of a values or scales tensor -> suffix of the logical weight's name.
LOGICAL_SUFFIXES = ((".weight_packed", ".weight"), (".weight_scale_inv", ".weight"),
                    (".weight_scale", ".weight"), (".input_scale", ".weight"), (BLOCKS_SUFFIX, ""),
                    (SCALES_SUFFIX, ""))
SCALE_SUFFIXES = (SCALES_SUFFIX, ".weight_scale", ".weight_scale_inv", ".input_scale")
COMPONENT_ORDER = ("embed_tokens", "lm_head", "routed_experts", "shared_experts", "latent_moe",
                   "moe_router", "dense_mlp", "kda_attention", "mla_attention", "norms", "vision",
                   "mtp", "unexpected", "unclassified")
MAX_SHOWN_PER_KIND = 20


@dataclass(frozen=True)
class StoredWeight:
    """One logical weight: a plain tensor, or quantized values with their scales."""

    name: str  # as stored; `X.weight` for `X.weight_packed`, `X` for gpt-oss `X_blocks`
    format: str  # mxfp4, fp8, int8, bf16, fp32, ...
    layout: str  # plain, scaled, mxfp4-blocks ([..., G, 16]) or mxfp4-flat ([..., G * 16])
    shape: tuple[int, ...]  # logical; MXFP4: [..., G * 32]
    tensors: tuple[TensorHeader, ...]  # values first, then scales

    @property
    def num_params(self) -> int:
        values = self.tensors[0]
        return values.numel * 2 if self.format == "mxfp4" else values.numel

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_per_rank(self, rank_fraction: float) -> float:
        # A single per-tensor scale is replicated; block scales shard with their values.
        return sum(t.nbytes * (1.0 if i and t.numel == 1 else rank_fraction)
                   for i, t in enumerate(self.tensors))


@dataclass(frozen=True)
class TensorInventory:
    tensors: dict[str, TensorHeader]  # from the readable files
    # Names the index puts in missing or unreadable shards (already reported); None: unknown,
    # because a file could not be read and no index lists its tensors.
    unavailable: frozenset[str] | None


@dataclass(frozen=True)
class Placed:
    """A stored weight with its component and the share of it one TP rank holds."""

    weight: StoredWeight
    component: str
    rank_fraction: float | None  # None: unknown (no Kimi config); 0.0: not loaded (MTP)


@dataclass(frozen=True)
class GroupSummary:
    component: str
    format: str
    sharding: str  # TP, replicated, not loaded, unknown
    num_weights: int  # a values + scales pair counts once
    num_params: int
    num_bytes: int
    bytes_per_rank: float | None


@dataclass(frozen=True)
class CheckpointReport:
    path: str
    files: tuple[str, ...]
    model_type: str | None
    tensor_parallel_size: int
    num_tensors: int  # safetensors entries
    groups: tuple[GroupSummary, ...]
    num_params: int
    num_bytes: int
    bytes_per_rank: float | None  # what one TP rank loads; MTP layers excluded
    model: ModelFacts | None  # from config.json, for the planner
    # Kinds: those of the files (missing_index, bad_index, missing_shard, no_tensors, bad_header,
    # truncated), then index_mismatch, duplicate_tensor, unpaired_blocks, unpaired_scales,
    # missing_scale, bad_scales, bad_config, bad_tp, missing_tensor, bad_shape, bad_dtype.
    problems: tuple[Problem, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


# ---- all headers -------------------------------------------------------------------------------


def read_inventory(files: CheckpointFiles) -> tuple[TensorInventory, list[Problem]]:
    """Every tensor header of every readable shard, and what is wrong with the rest."""
    tensors: dict[str, TensorHeader] = {}
    problems: list[Problem] = []
    readable: set[str] = set()
    for shard in files.shards:
        try:
            headers = read_safetensors_header(shard)
        except HeaderError as exc:
            problems.append(Problem(exc.kind, str(exc)))
            continue
        readable.add(shard.name)
        problems += _add_tensors(tensors, headers, files.root)
    if files.weight_map is None:
        unreadable = len(readable) < len(files.shards)
        return TensorInventory(tensors, None if unreadable else frozenset()), problems
    problems += _index_mismatches(files, tensors, readable)
    unavailable = frozenset(n for n, s in files.weight_map.items() if s not in readable)
    return TensorInventory(tensors, unavailable), problems


def _add_tensors(tensors: dict[str, TensorHeader], headers: tuple[TensorHeader, ...],
                 root: Path) -> list[Problem]:
    problems = []
    for t in headers:
        if t.name in tensors:
            problems.append(Problem("duplicate_tensor", f"{t.name}: in both {root / t.file} "
                                    f"and {root / tensors[t.name].file}"))
            continue
        tensors[t.name] = t
    return problems


def _index_mismatches(files: CheckpointFiles, tensors: dict[str, TensorHeader],
                      readable: set[str]) -> list[Problem]:
    assert files.weight_map is not None
    absent, unlisted = defaultdict(list), defaultdict(list)
    for name, shard in files.weight_map.items():
        if shard in readable and (name not in tensors or tensors[name].file != shard):
            absent[shard].append(name)
    for name, t in tensors.items():
        if name not in files.weight_map:
            unlisted[t.file].append(name)
    return ([_mismatch(files.root / s, n, f"{INDEX_FILE} maps them here, the header lacks them")
             for s, n in absent.items()]
            + [_mismatch(files.root / s, n, f"in the header, not in {INDEX_FILE}")
               for s, n in unlisted.items()])


def _mismatch(shard: Path, names: list[str], what: str) -> Problem:
    return Problem("index_mismatch", f"{shard}: {len(names):,} tensor(s) {what}, e.g. {names[0]}")


# ---- pairing values with scales ----------------------------------------------------------------


def pair_weights(inventory: TensorInventory) -> tuple[list[StoredWeight], list[Problem]]:
    """Group tensors into logical weights: MXFP4 blocks + scales, FP8 + scale, or one tensor.

    A weight with a tensor in an unavailable shard is not reported again: the shard's problem is.
    """
    tensors, weights, problems, used = inventory.tensors, [], [], set()
    gone = {logical_name(n) for n in inventory.unavailable or ()}
    for t in tensors.values():
        weight, problem, consumed = _pair(t, tensors)
        used.update(consumed)
        weights += [weight] if weight else []
        problems += [problem] if problem and logical_name(t.name) not in gone else []
    for name, t in tensors.items():
        if name in used:
            continue
        orphan = _orphan_scale(t, tensors)
        if orphan is None:
            weights.append(_plain(t))
        elif logical_name(name) not in gone:
            problems.append(orphan)
    return weights, problems


def logical_name(name: str) -> str:
    """The weight a values or scales tensor belongs to: `X.weight_packed` -> `X.weight`."""
    for suffix, replacement in LOGICAL_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)] + replacement
    return name


# (weight, problem, names of the tensors it consumed); nothing consumed: not a quantized weight.
Paired = tuple[StoredWeight | None, Problem | None, tuple[str, ...]]


def _pair(t: TensorHeader, tensors: dict[str, TensorHeader]) -> Paired:
    if t.name.endswith(BLOCKS_SUFFIX):
        base = t.name.removesuffix(BLOCKS_SUFFIX)
        return _pair_mxfp4(t, tensors.get(base + SCALES_SUFFIX), base, allow_flat=False)
    if t.name.endswith(".weight_packed"):
        base = t.name[:-len("_packed")]
        return _pair_mxfp4(t, tensors.get(base + "_scale"), base, allow_flat=True)
    if t.name.endswith(".weight") and t.dtype in SCALED_WEIGHT_FORMATS:
        return _pair_scaled(t, tensors)
    return None, None, ()


def _pair_mxfp4(blocks: TensorHeader, scales: TensorHeader | None, name: str,
                allow_flat: bool) -> Paired:
    if scales is None:
        expected = name + ("_scale" if allow_flat else SCALES_SUFFIX)
        return None, Problem("unpaired_blocks", f"{blocks.name} ({blocks.file}): MXFP4 blocks "
                             f"without scales; expected {expected}"), (blocks.name,)
    consumed = (blocks.name, scales.name)
    if not dtypes_fit(blocks.dtype, scales.dtype):
        return None, Problem("bad_dtype", f"{blocks.name} / {scales.name}: MXFP4 needs U8 blocks "
                             f"and {' or '.join(SCALES_DTYPES)} scales, got {blocks.dtype} and "
                             f"{scales.dtype}"), consumed
    layout = packed_layout(blocks.shape, scales.shape, allow_flat=allow_flat)
    if layout is None:
        problem = Problem("bad_scales", _bad_scales_message(blocks, scales, allow_flat))
        return None, problem, consumed
    return StoredWeight(name, "mxfp4", layout[0], layout[1], (blocks, scales)), None, consumed


def _bad_scales_message(blocks: TensorHeader, scales: TensorHeader, allow_flat: bool) -> str:
    wanted = (f"[..., G] with blocks [..., G, {BLOCK_BYTES}]"
              + (f" or [..., G * {BLOCK_BYTES}]" if allow_flat else ""))
    return (f"{scales.name} {list(scales.shape)} does not fit {blocks.name} "
            f"{list(blocks.shape)}: MXFP4 needs one scale per 16-byte block of 32 values, scales "
            f"{wanted}")


def _pair_scaled(t: TensorHeader, tensors: dict[str, TensorHeader]) -> Paired:
    base = t.name[:-len(".weight")]
    scale = tensors.get(base + ".weight_scale") or tensors.get(base + ".weight_scale_inv")
    if scale is None:
        return None, Problem("missing_scale", f"{t.name} ({t.file}): {t.dtype} weight without "
                             f"{base}.weight_scale or {base}.weight_scale_inv"), (t.name,)
    extra = tuple(x for x in (tensors.get(base + ".input_scale"),) if x is not None)
    weight = StoredWeight(t.name, SCALED_WEIGHT_FORMATS[t.dtype], "scaled", t.shape,
                          (t, scale, *extra))
    return weight, None, tuple(x.name for x in weight.tensors)


def _orphan_scale(t: TensorHeader, tensors: dict[str, TensorHeader]) -> Problem | None:
    if not t.name.endswith(SCALE_SUFFIXES):
        return None
    if t.name.endswith(".input_scale") and t.name[:-len(".input_scale")] + ".weight" in tensors:
        return None  # activation scale of a float weight (static FP8 activations)
    return Problem("unpaired_scales", f"{t.name} ({t.file}): scales without the quantized "
                   "weight they belong to")


def _plain(t: TensorHeader) -> StoredWeight:
    return StoredWeight(t.name, FLOAT_FORMATS.get(t.dtype, t.dtype.lower()), "plain", t.shape, (t,))


# ---- config.json and the expected tensors ------------------------------------------------------


def load_config(root: Path) -> tuple[KimiCheckpointConfig | None, list[Problem], list[str]]:
    """The Kimi config beside the checkpoint; (None, [], [note]) when there is none to check."""
    path = root / CONFIG_FILE
    if not path.is_file():
        note = (f"no {CONFIG_FILE} in {root}: expected tensors, shapes and TP shares not checked; "
                "only headers and quantized pairs were")
        return None, [], [note]
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, [Problem("bad_config", f"{path}: not valid JSON ({exc})")], []
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        note = (f"{path}: model_type {model_type!r} is not one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; expected tensors not checked")
        draft = dspark_draft_kind(data) if isinstance(data, dict) else None
        return None, [], [note] + ([f"a DSpark draft; vLLM runs it as {draft}"] if draft else [])
    try:
        return KimiCheckpointConfig.from_dict(data), [], []
    except ConfigError as exc:
        return None, [Problem("bad_config", f"{path}: {exc}")], []


def place_weights(
        cfg: KimiCheckpointConfig | None, weights: list[StoredWeight], tp: int,
        unavailable: frozenset[str] | None) -> tuple[list[Placed], list[Problem], list[str]]:
    """Match stored weights to the expected tensors; unknown placement without a config.

    Expected tensors in `unavailable` shards (all of them, when None) are not reported missing.
    """
    if cfg is None:
        return [Placed(w, "unclassified", None) for w in weights], [], []
    try:
        expected = expected_tensors(cfg, tp)
    except ConfigError as exc:
        unplaced = [Placed(w, "unclassified", None) for w in weights]
        return unplaced, [Problem("bad_config", str(exc))], []
    by_name = {normalize_name(w.name): w for w in weights}
    gone = None if unavailable is None else {normalize_name(logical_name(n)) for n in unavailable}
    placed, problems = _place_expected(cfg, expected, by_name, gone)
    extra, warnings = _place_unexpected(cfg, by_name, {e.name for e in expected})
    return placed + extra, _tp_problems(cfg, tp) + problems, warnings


def _place_expected(cfg: KimiCheckpointConfig, expected: list[ExpectedTensor],
                    by_name: dict[str, StoredWeight],
                    gone: set[str] | None) -> tuple[list[Placed], list[Problem]]:
    placed, problems = [], []
    for e in expected:
        weight = by_name.get(e.name)
        if weight is None and (gone is None or e.name in gone):
            continue  # its file's problem is already reported
        if weight is None:
            problems.append(Problem("missing_tensor", f"missing {e.name} {list(e.shape)} = "
                                    f"{e.dims} ({e.component})"))
            continue
        problems += weight_problems(cfg, e, weight)
        placed.append(Placed(weight, e.component, e.rank_fraction))
    return placed, problems


def _place_unexpected(cfg: KimiCheckpointConfig, by_name: dict[str, StoredWeight],
                      expected: set[str]) -> tuple[list[Placed], list[str]]:
    placed, warnings = [], []
    for name, weight in by_name.items():
        if name in expected:
            continue
        if is_mtp_name(cfg, name):
            placed.append(Placed(weight, "mtp", 0.0))
            continue
        placed.append(Placed(weight, "unexpected", 1.0))
        warnings.append(f"{weight.name}: not a tensor vLLM's Kimi K3 loader expects for this "
                        "config; it may reject it (counted as replicated)")
    return placed, warnings


def _tp_problems(cfg: KimiCheckpointConfig, tp: int) -> list[Problem]:
    heads = {"num_attention_heads": cfg.text.num_attention_heads}
    if cfg.text.kda is not None:
        heads["linear_attn_config.num_heads"] = cfg.text.kda.num_heads
    return [Problem("bad_tp", f"TP={tp} does not divide {field}={n}; vLLM refuses this layout")
            for field, n in heads.items() if tp < 1 or n % tp]


def weight_problems(cfg: KimiCheckpointConfig, e: ExpectedTensor, w: StoredWeight) -> list[Problem]:
    """Dtype and shape of one stored weight against what the loader expects."""
    problems = [_dtype_problem(cfg, e, w)]
    if w.shape != e.shape and w.shape not in e.alt_shapes:
        logical = " (logical, from MXFP4 blocks)" if w.format == "mxfp4" else ""
        problems.append(Problem("bad_shape", f"{w.name}: shape {list(w.shape)}{logical}, expected "
                                f"{list(e.shape)} = {e.dims}"))
    elif w.layout == "mxfp4-blocks":
        packed = w.tensors[0]
        problems.append(Problem("bad_shape", f"{packed.name}: {list(packed.shape)} is the gpt-oss "
                                "block view [..., G, 16]; vLLM's compressed-tensors MXFP4 loader "
                                f"reads [..., G * 16] (same bytes: reshape to "
                                f"{list(packed.shape[:-2]) + [packed.shape[-2] * 16]})"))
    return [p for p in problems if p]


_FLOATS = frozenset(FLOAT_FORMATS.values())
_LINEAR_FORMATS = _FLOATS | {"fp8", "int8", "mxfp4"}


def _dtype_problem(cfg: KimiCheckpointConfig, e: ExpectedTensor, w: StoredWeight) -> Problem | None:
    allowed = _FLOATS if e.kind in ("float", "embedding") else _LINEAR_FORMATS
    if e.kind == "expert" and cfg.mxfp4_experts:
        allowed = frozenset({"mxfp4"})
    if w.format in allowed:
        return None
    dtypes = "+".join(t.dtype for t in w.tensors)
    why = " (config.json's quantization_config is MXFP4)" if e.kind == "expert" else ""
    return Problem("bad_dtype", f"{w.name}: stored as {w.format} ({dtypes}), expected "
                   f"{' or '.join(sorted(allowed))} for {e.component}{why}")


# ---- the report --------------------------------------------------------------------------------


def check_checkpoint(path: str | Path, tensor_parallel_size: int = 8) -> CheckpointReport:
    """Check a checkpoint directory (index + shards, or one file) or a single safetensors file.

    Raises FileNotFoundError when `path` does not exist; everything else is a Problem in the report.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    files, problems = locate_files(root)
    inventory, read_problems = read_inventory(files)
    weights, pair_problems = pair_weights(inventory)
    cfg, config_problems, notes = load_config(files.root)
    placed, place_problems, warnings = place_weights(cfg, weights, tensor_parallel_size,
                                                     inventory.unavailable)
    notes += _notes(cfg, files, inventory)
    return _report(root, files, inventory.tensors, placed, cfg, tensor_parallel_size,
                   problems + read_problems + pair_problems + config_problems + place_problems,
                   warnings, notes)


def _notes(cfg: KimiCheckpointConfig | None, files: CheckpointFiles,
           inventory: TensorInventory) -> list[str]:
    notes = [f"{name}: not in {INDEX_FILE}; vLLM skips it" for name in files.unindexed]
    if cfg is not None and inventory.unavailable is None:
        notes.append("presence of expected tensors not checked: a file could not be read and no "
                     f"{INDEX_FILE} says which tensors it holds")
    if cfg is not None:
        notes.append(f"expected names, shapes and TP rules: vLLM 0.32's Kimi K3 loader "
                     f"(model_type {cfg.model_type}; see pipeline/capacity/kimi_k3_layout.py)")
    return notes


def _report(root: Path, files: CheckpointFiles, tensors: dict[str, TensorHeader],
            placed: list[Placed], cfg: KimiCheckpointConfig | None, tp: int,
            problems: list[Problem], warnings: list[str], notes: list[str]) -> CheckpointReport:
    groups = summarize(placed)
    per_rank = [g.bytes_per_rank for g in groups]
    return CheckpointReport(
        str(root), tuple(p.name for p in files.shards), cfg.model_type if cfg else None, tp,
        len(tensors), groups, sum(g.num_params for g in groups), sum(g.num_bytes for g in groups),
        None if None in per_rank else sum(per_rank), cfg.facts() if cfg else None,
        tuple(problems), tuple(warnings), tuple(notes))


def summarize(placed: list[Placed]) -> tuple[GroupSummary, ...]:
    """Totals by (component, format, sharding), in COMPONENT_ORDER."""
    groups: dict[tuple[str, str, str], list[Placed]] = defaultdict(list)
    for p in placed:
        groups[(p.component, p.weight.format, _sharding(p.rank_fraction))].append(p)
    order = {c: i for i, c in enumerate(COMPONENT_ORDER)}
    keys = sorted(groups, key=lambda k: (order.get(k[0], len(order)), k))
    return tuple(_group(k, groups[k]) for k in keys)


def _sharding(rank_fraction: float | None) -> str:
    if rank_fraction is None:
        return "unknown"
    if rank_fraction == 0.0:
        return "not loaded"
    return "replicated" if rank_fraction >= 1.0 else "TP"


def _group(key: tuple[str, str, str], members: list[Placed]) -> GroupSummary:
    unknown = any(m.rank_fraction is None for m in members)
    per_rank = None if unknown else sum(m.weight.bytes_per_rank(m.rank_fraction) for m in members)
    return GroupSummary(*key, len(members), sum(m.weight.num_params for m in members),
                        sum(m.weight.num_bytes for m in members), per_rank)


def report_to_dict(report: CheckpointReport) -> dict:
    """JSON-ready dict of the report, with `ok`."""
    return {**json.loads(json.dumps(dataclasses.asdict(report))), "ok": report.ok}


def format_report(report: CheckpointReport) -> str:
    """Readable tables: groups, totals, problems (capped per kind), warnings and notes."""
    title = (f"moonserve check-checkpoint: {report.path} ({len(report.files)} file(s), "
             f"{report.num_tensors:,} tensors, model_type {report.model_type}, "
             f"TP={report.tensor_parallel_size})")
    sections = [title, _format_groups(report), _format_problems(report.problems)]
    sections += [_format_list("Warnings", report.warnings), _format_list("Notes", report.notes)]
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    return "\n\n".join(s for s in sections if s) + f"\n\nresult: {verdict}\n"


def _format_groups(report: CheckpointReport) -> str:
    rows = [(g.component, g.format, g.sharding, f"{g.num_weights:,}", f"{g.num_params:,}",
             _bytes(g.num_bytes), _bytes(g.bytes_per_rank)) for g in report.groups]
    rows.append(("total", "", "", "", f"{report.num_params:,}", _bytes(report.num_bytes),
                 _bytes(report.bytes_per_rank)))
    headers = ("component", "format", "sharding", "weights", "params", "bytes", "bytes per rank")
    cells = [headers, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _bytes(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def _format_problems(problems: tuple[Problem, ...]) -> str:
    by_kind: dict[str, list[str]] = defaultdict(list)
    for p in problems:
        by_kind[p.kind].append(p.message)
    lines = []
    for kind, messages in by_kind.items():
        lines += [f"  {kind}: {m}" for m in messages[:MAX_SHOWN_PER_KIND]]
        if len(messages) > MAX_SHOWN_PER_KIND:
            lines.append(f"  {kind}: ... and {len(messages) - MAX_SHOWN_PER_KIND:,} more")
    return f"Problems ({len(problems)})\n" + "\n".join(lines) if problems else ""


def _format_list(title: str, items: tuple[str, ...]) -> str:
    lines = [f"  {item}" for item in items[:MAX_SHOWN_PER_KIND]]
    if len(items) > MAX_SHOWN_PER_KIND:
        lines.append(f"  ... and {len(items) - MAX_SHOWN_PER_KIND:,} more")
    return f"{title} ({len(items)})\n" + "\n".join(lines) if items else ""
