"""`moonserve check-checkpoint`: preflight a safetensors checkpoint from its headers alone.

Reads each file's 8-byte little-endian header length and its JSON header, never tensor data, so
a 1.5 TB checkpoint takes seconds. Pairs quantized weights with their scales, checks every tensor
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
import math
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

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

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
MXFP4_BLOCK_BYTES = 16  # 32 E2M1 codes, two per byte
MXFP4_BLOCK_SIZE = 32
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
SCALED_WEIGHT_FORMATS = {"F8_E4M3": "fp8", "F8_E5M2": "fp8", "F8_E4M3FNUZ": "fp8",
                         "F8_E5M2FNUZ": "fp8", "I8": "int8"}
E8M0_DTYPES = ("U8", "F8_E8M0")
# Suffix of a values or scales tensor -> suffix of the logical weight's name.
LOGICAL_SUFFIXES = ((".weight_packed", ".weight"), (".weight_scale_inv", ".weight"),
                    (".weight_scale", ".weight"), (".input_scale", ".weight"), ("_blocks", ""),
                    ("_scales", ""))
SCALE_SUFFIXES = ("_scales", ".weight_scale", ".weight_scale_inv", ".input_scale")
COMPONENT_ORDER = ("embed_tokens", "lm_head", "routed_experts", "shared_experts", "latent_moe",
                   "moe_router", "dense_mlp", "kda_attention", "mla_attention", "norms", "vision",
                   "mtp", "unexpected", "unclassified")
MAX_SHOWN_PER_KIND = 20


class HeaderError(Exception):
    """One safetensors file cannot be read; `kind` is a Problem kind, the message names the file."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Problem:
    """Something that would stop vLLM loading the checkpoint, or make it load the wrong thing.

    kind: missing_index, bad_index, missing_shard, no_tensors, bad_header, truncated,
    index_mismatch, duplicate_tensor, unpaired_blocks, unpaired_scales, missing_scale, bad_scales,
    bad_config, bad_tp, missing_tensor, bad_shape, bad_dtype.
    """

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name inside the checkpoint directory
    begin: int  # data_offsets, relative to the end of the header
    end: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


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
class CheckpointFiles:
    root: Path  # the directory holding config.json and the index
    shards: tuple[Path, ...]  # the files to read
    weight_map: dict[str, str] | None  # tensor name -> shard file name, from the index
    unindexed: tuple[str, ...]  # *.safetensors files the index does not name (vLLM skips them)


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
    problems: tuple[Problem, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


# ---- one safetensors header --------------------------------------------------------------------


def read_safetensors_header(path: Path) -> tuple[TensorHeader, ...]:
    """Tensor headers of one file, from its first 8 + N bytes only; HeaderError names the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = _header_length(path, f.read(8), size)
        raw = f.read(header_len)
    entries = _parse_header(path, raw)
    tensors = tuple(_tensor_header(path, path.name, name, entry)
                    for name, entry in entries.items() if name != "__metadata__")
    _check_within_file(path, tensors, size, header_len)
    return tensors


def _header_length(path: Path, prefix: bytes, size: int) -> int:
    if len(prefix) < 8:
        raise HeaderError("truncated", f"{path}: {size} bytes, too short for the 8-byte header "
                          "length: truncated, or not a safetensors file")
    header_len = struct.unpack("<Q", prefix)[0]
    if header_len > size - 8:
        raise HeaderError("bad_header", f"{path}: header length {header_len:,} bytes runs past "
                          f"the end of the {size:,}-byte file: truncated or corrupt")
    if header_len > MAX_HEADER_BYTES:
        raise HeaderError("bad_header", f"{path}: header length {header_len:,} bytes exceeds "
                          f"safetensors' {MAX_HEADER_BYTES:,}-byte limit: corrupt")
    return header_len


def _parse_header(path: Path, raw: bytes) -> dict:
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError("bad_header", f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(entries, dict):
        raise HeaderError("bad_header",
                          f"{path}: header is {type(entries).__name__}, not an object")
    return entries


def _tensor_header(path: Path, file_name: str, name: str, entry: object) -> TensorHeader:
    # Runs once per tensor (~500k in a Kimi K3 checkpoint): C builtins only on the good path.
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        bits, numel = DTYPE_BITS[dtype], math.prod(shape)
        valid = (type(numel) is type(begin) is type(end) is int and 0 <= begin <= end
                 and min(shape, default=0) >= 0)
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise HeaderError("bad_header", _bad_entry_message(path, name, entry))
    if end - begin != -(-numel * bits // 8):
        raise HeaderError("bad_header", f"{path}: tensor {name}: data_offsets span "
                          f"{end - begin:,} bytes, but {dtype} {shape} needs "
                          f"{-(-numel * bits // 8):,}")
    return TensorHeader(name, dtype, tuple(shape), file_name, begin, end, numel)


def _bad_entry_message(path: Path, name: str, entry: object) -> str:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        return f"{where}: entry is {entry!r}, not an object with dtype, shape, data_offsets"
    if entry.get("dtype") not in DTYPE_BITS:
        return f"{where}: unknown dtype {entry.get('dtype')!r}"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return f"{where}: bad shape {shape!r} or data_offsets {offsets!r}"


def _check_within_file(path: Path, tensors: tuple[TensorHeader, ...], size: int,
                       header_len: int) -> None:
    data_size = size - 8 - header_len
    beyond = [t for t in tensors if t.end > data_size]
    if beyond:
        last = max(beyond, key=lambda t: t.end)
        raise HeaderError("truncated", f"{path}: {len(beyond)} tensor(s) end past the end of the "
                          f"file, e.g. {last.name} ends at byte {8 + header_len + last.end:,} of a "
                          f"{size:,}-byte file: the file is truncated")


# ---- which files -------------------------------------------------------------------------------


def locate_files(path: Path) -> tuple[CheckpointFiles, list[Problem]]:
    """The files to read: one file, the index's shards, or a directory's single file."""
    if path.is_file():
        return CheckpointFiles(path.parent, (path,), None, ()), []
    if (path / INDEX_NAME).is_file():
        return _files_from_index(path)
    return _files_without_index(path)


def _files_from_index(root: Path) -> tuple[CheckpointFiles, list[Problem]]:
    index = root / INDEX_NAME
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        return CheckpointFiles(root, (), None, ()), [Problem("bad_index", f"{index}: not a JSON "
                                                             f"object with a weight_map ({exc})")]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return CheckpointFiles(root, (), None, ()), [Problem(
            "bad_index", f"{index}: weight_map must map tensor names to shard file names")]
    shards = sorted(set(weight_map.values()))
    problems = [_missing_shard(index, shard, weight_map) for shard in shards
                if not (root / shard).is_file()]
    unindexed = tuple(sorted(p.name for p in root.glob("*.safetensors") if p.name not in shards))
    present = tuple(root / s for s in shards if (root / s).is_file())
    return CheckpointFiles(root, present, weight_map, unindexed), problems


def _missing_shard(index: Path, shard: str, weight_map: dict[str, str]) -> Problem:
    names = [n for n, s in weight_map.items() if s == shard]
    return Problem("missing_shard", f"{index.parent / shard}: missing; {INDEX_NAME} maps "
                   f"{len(names):,} tensor(s) to it, e.g. {names[0]}")


def _files_without_index(root: Path) -> tuple[CheckpointFiles, list[Problem]]:
    files = tuple(sorted(root.glob("*.safetensors")))
    if not files:
        return CheckpointFiles(root, (), None, ()), [
            Problem("no_tensors", f"{root}: no *.safetensors files")]
    problems = [] if len(files) == 1 else [Problem(
        "missing_index", f"{root}: {len(files)} .safetensors files but no {INDEX_NAME}; without "
        "it nothing says which files make up the checkpoint (transformers refuses to load it, "
        "vLLM would load every file, strays included). Restore the index from the release.")]
    return CheckpointFiles(root, files, None, ()), problems


# ---- all headers -------------------------------------------------------------------------------


def read_tensors(files: CheckpointFiles) -> tuple[TensorInventory, list[Problem]]:
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
    return ([_mismatch(files.root / s, n, f"{INDEX_NAME} maps them here, the header lacks them")
             for s, n in absent.items()]
            + [_mismatch(files.root / s, n, f"in the header, not in {INDEX_NAME}")
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
    if t.name.endswith("_blocks"):
        base = t.name[:-len("_blocks")]
        return _pair_mxfp4(t, tensors.get(base + "_scales"), base, allow_flat=False)
    if t.name.endswith(".weight_packed"):
        base = t.name[:-len("_packed")]
        return _pair_mxfp4(t, tensors.get(base + "_scale"), base, allow_flat=True)
    if t.name.endswith(".weight") and t.dtype in SCALED_WEIGHT_FORMATS:
        return _pair_scaled(t, tensors)
    return None, None, ()


def _pair_mxfp4(blocks: TensorHeader, scales: TensorHeader | None, name: str,
                allow_flat: bool) -> Paired:
    if scales is None:
        expected = name + ("_scale" if allow_flat else "_scales")
        return None, Problem("unpaired_blocks", f"{blocks.name} ({blocks.file}): MXFP4 blocks "
                             f"without scales; expected {expected}"), (blocks.name,)
    consumed = (blocks.name, scales.name)
    if blocks.dtype != "U8" or scales.dtype not in E8M0_DTYPES:
        return None, Problem("bad_dtype", f"{blocks.name} / {scales.name}: MXFP4 needs U8 blocks "
                             f"and U8 or F8_E8M0 scales, got {blocks.dtype} and "
                             f"{scales.dtype}"), consumed
    layout = mxfp4_layout(blocks.shape, scales.shape, allow_flat)
    if layout is None:
        problem = Problem("bad_scales", _bad_scales_message(blocks, scales, allow_flat))
        return None, problem, consumed
    return StoredWeight(name, "mxfp4", layout[0], layout[1], (blocks, scales)), None, consumed


def mxfp4_layout(blocks: tuple[int, ...], scales: tuple[int, ...],
                 allow_flat: bool) -> tuple[str, tuple[int, ...]] | None:
    """("mxfp4-blocks" | "mxfp4-flat", logical shape) when blocks and scales agree, else None.

    >>> mxfp4_layout((896, 4096, 224, 16), (896, 4096, 224), allow_flat=False)
    ('mxfp4-blocks', (896, 4096, 7168))
    >>> mxfp4_layout((4096, 3584), (4096, 224), allow_flat=True)
    ('mxfp4-flat', (4096, 7168))
    """
    if len(blocks) >= 2 and blocks[-1] == MXFP4_BLOCK_BYTES and scales == blocks[:-1]:
        return "mxfp4-blocks", blocks[:-2] + (blocks[-2] * MXFP4_BLOCK_SIZE,)
    flat = (allow_flat and len(blocks) == len(scales) >= 1 and scales[:-1] == blocks[:-1]
            and blocks[-1] == scales[-1] * MXFP4_BLOCK_BYTES)
    return ("mxfp4-flat", blocks[:-1] + (blocks[-1] * 2,)) if flat else None


def _bad_scales_message(blocks: TensorHeader, scales: TensorHeader, allow_flat: bool) -> str:
    wanted = "[..., G] with blocks [..., G, 16]" + (" or [..., G * 16]" if allow_flat else "")
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
    path = root / CONFIG_NAME
    if not path.is_file():
        note = (f"no {CONFIG_NAME} in {root}: expected tensors, shapes and TP shares not checked; "
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
        return None, [], [note]
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
    inventory, read_problems = read_tensors(files)
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
    notes = [f"{name}: not in {INDEX_NAME}; vLLM skips it" for name in files.unindexed]
    if cfg is not None and inventory.unavailable is None:
        notes.append("presence of expected tensors not checked: a file could not be read and no "
                     f"{INDEX_NAME} says which tensors it holds")
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
