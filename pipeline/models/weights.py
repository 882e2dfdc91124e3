"""Checkpoint files: which safetensors files hold which tensors, and reading tensors or only headers.

Every reader of a checkpoint goes through here: the LanguageModel's token embedding table, the DSpark
drafter and the target tensors it shares, MoonViT's vision tensors, and `moonserve check-checkpoint`.

* Discovery: one file; a directory's ``model.safetensors.index.json`` (its ``weight_map`` says which
  shard holds each tensor; vLLM and transformers read it too); or, without an index, every
  ``*.safetensors`` file in the directory. ``locate_files`` reports what is wrong as Problems (the
  preflight lists them all); ``tensor_files`` raises on the first (a loader cannot go on).
* Tensors: ``read_tensors`` / ``load_tensors`` with safetensors' ``safe_open``, one open per file.
* Headers: ``read_safetensors_header`` gives every tensor's dtype, shape and byte size from
  ``safe_open(...).get_slice(name)``, which reads the header only (the file is memory-mapped, its
  tensor data never touched), so a 1.5 TB checkpoint is checked in seconds. Torch is not needed.

Example:
    >>> files = tensor_files("/models/Kimi-K3.1-Pro")  # doctest: +SKIP
    >>> name = find_tensor(files, TOKEN_EMBEDDING_NAMES)  # doctest: +SKIP
    >>> read_tensors(files, [name])[name].shape  # doctest: +SKIP
    torch.Size([163840, 7168])
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moonserve.kernels.mxfp4.format import is_packed_part

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = f"{WEIGHTS_FILE}.index.json"
# Where a target checkpoint keeps its input embedding and, when not tied to it, its LM head:
# Llama / DeepSeek at the top, Kimi-VL-style wrappers (K3) under language_model.*. The target's own
# tables, not a drafter's or an MTP layer's.
TOKEN_EMBEDDING_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class Problem:
    """Something that would stop vLLM loading the checkpoint, or make it load the wrong thing.

    Kinds found here: missing_index, bad_index, missing_shard, no_tensors (which files), bad_header,
    truncated (one file's header). `moonserve.pipeline.capacity.checkpoint` adds the others.
    """

    kind: str
    message: str


@dataclass(frozen=True)
class CheckpointFiles:
    root: Path  # the directory holding config.json and the index
    shards: tuple[Path, ...]  # the files to read (those present)
    weight_map: dict[str, str] | None  # tensor name -> shard file name, from the index
    unindexed: tuple[str, ...]  # *.safetensors files the index does not name (vLLM skips them)


def locate_files(path: Path) -> tuple[CheckpointFiles, list[Problem]]:
    """The files to read: one file, the index's shards, or a directory's *.safetensors files."""
    path = Path(path)
    if path.is_file():
        return CheckpointFiles(path.parent, (path,), None, ()), []
    if (path / INDEX_FILE).is_file():
        return _files_from_index(path)
    return _files_without_index(path)


def _files_from_index(root: Path) -> tuple[CheckpointFiles, list[Problem]]:
    index = root / INDEX_FILE
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
    return Problem("missing_shard", f"{index.parent / shard}: missing; {INDEX_FILE} maps "
                   f"{len(names):,} tensor(s) to it, e.g. {names[0]}")


def _files_without_index(root: Path) -> tuple[CheckpointFiles, list[Problem]]:
    files = tuple(sorted(root.glob("*.safetensors")))
    if not files:
        return CheckpointFiles(root, (), None, ()), [
            Problem("no_tensors", f"{root}: no *.safetensors files")]
    problems = [] if len(files) == 1 else [Problem(
        "missing_index", f"{root}: {len(files)} .safetensors files but no {INDEX_FILE}; without "
        "it nothing says which files make up the checkpoint (transformers refuses to load it, "
        "vLLM would load every file, strays included). Restore the index from the release.")]
    return CheckpointFiles(root, files, None, ()), problems


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a file or a checkpoint directory.

    From the index when there is one, else from each file's header (a later file wins a name
    two files hold). Raises FileNotFoundError without safetensors files or with a shard the index
    names missing, ValueError for an unreadable index; several files and no index is accepted.
    """
    files, problems = locate_files(Path(path))
    for problem in problems:
        if problem.kind != "missing_index":
            raise (ValueError if problem.kind == "bad_index" else FileNotFoundError)(problem.message)
    if files.weight_map is not None:
        return {name: files.root / shard for name, shard in files.weight_map.items()}
    from safetensors import safe_open

    located: dict[str, Path] = {}
    for file in files.shards:
        with safe_open(str(file), framework="numpy") as f:
            located.update(dict.fromkeys(f.keys(), file))
    return located


def find_tensor(files: Mapping[str, Path], candidates: Iterable[str]) -> str | None:
    """The first of candidates the checkpoint holds (e.g. TOKEN_EMBEDDING_NAMES), else None."""
    return next((name for name in candidates if name in files), None)


def read_tensors(files: Mapping[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors, in the checkpoint's dtype, on CPU; each file is opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[files[name]].append(name)
    tensors = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            tensors.update((name, f.get_tensor(name)) for name in file_names)
    return tensors


def load_tensors(path: str | Path, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (file or directory), or those whose name `select` accepts."""
    files = tensor_files(path)
    return read_tensors(files, [name for name in files if select is None or select(name)])


def place_tensors(tensors: Mapping[str, torch.Tensor], device: str | torch.device,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors moved to device, contiguous; float ones cast to dtype, MXFP4 halves (``X_blocks``,
    ``X_scales``) keep theirs: float8_e8m0fnu scales are floats to torch, but hold exponents."""
    return {name: (t.to(device) if is_packed_part(name) else t.to(device, dtype)).contiguous()
            for name, t in tensors.items()}


class HeaderError(Exception):
    """One safetensors file cannot be read; `kind` is a Problem kind, the message names the file."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors' name: BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    file: str  # file name inside the checkpoint directory
    numel: int
    nbytes: int  # what its data takes in the file


def read_safetensors_header(path: Path) -> tuple[TensorHeader, ...]:
    """Every tensor's header in one file, in storage order, without reading tensor data.

    safe_open validates the header (JSON, dtypes, shapes, offsets back to back and covering the
    file exactly); a file it refuses raises HeaderError with the kind and message the preflight
    reports.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return tuple(_tensor_header(path, name, f.get_slice(name)) for name in f.offset_keys())
    except SafetensorError as exc:
        raise _refusal(path, str(exc).removeprefix("Error while deserializing header: ")) from None


def _tensor_header(path: Path, name: str, view) -> TensorHeader:
    # Runs once per tensor (~500k in a Kimi K3 checkpoint).
    dtype, shape = view.get_dtype(), tuple(view.get_shape())
    if dtype not in DTYPE_BITS:  # a dtype newer than this table
        raise HeaderError("bad_header", f"{path}: tensor {name}: unknown dtype {dtype!r}")
    numel = math.prod(shape)
    # safe_open has checked that the data span is exactly this (sub-byte dtypes: whole bytes).
    return TensorHeader(name, dtype, shape, path.name, numel, numel * DTYPE_BITS[dtype] // 8)


def _refusal(path: Path, detail: str) -> HeaderError:
    """Why safe_open refused path, naming the file and the tensor (safetensors' messages do not):
    from the 8-byte length prefix, or from the raw header where the data does not fit it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
    if len(prefix) < 8:
        return HeaderError("truncated", f"{path}: {size} bytes, too short for the 8-byte header "
                           "length: truncated, or not a safetensors file")
    header_len = struct.unpack("<Q", prefix)[0]
    if header_len > size - 8:
        return HeaderError("bad_header", f"{path}: header length {header_len:,} bytes runs past "
                           f"the end of the {size:,}-byte file: truncated or corrupt")
    if header_len > MAX_HEADER_BYTES:
        return HeaderError("bad_header", f"{path}: header length {header_len:,} bytes exceeds "
                           f"safetensors' {MAX_HEADER_BYTES:,}-byte limit: corrupt")
    return _header_refusal(path, detail, size, header_len)


# serde's words for JSON that parses but is not a safetensors header.
_SCHEMA_ERRORS = ("invalid type", "invalid value", "unknown variant", "missing field",
                  "invalid length", "duplicate field", "unknown field")


def _header_refusal(path: Path, detail: str, size: int, header_len: int) -> HeaderError:
    if detail.startswith(("invalid UTF-8 in header", "invalid JSON in header")):
        reason = detail.split(": ", 1)[-1]
        dtype = re.match(r"unknown variant `([^`]*)`.* at (line \d+ column \d+)$", reason)
        if dtype:  # serde goes on to list every dtype it knows
            return HeaderError("bad_header", f"{path}: header names unknown dtype {dtype[1]!r} "
                               f"(at {dtype[2]})")
        what = "not a safetensors header" if reason.startswith(_SCHEMA_ERRORS) else "not valid JSON"
        return HeaderError("bad_header", f"{path}: header is {what} ({reason})")
    if detail.startswith("invalid shape, data type, or offset"):
        return _span_refusal(path, header_len)
    if detail.startswith("incomplete metadata"):
        return _extent_refusal(path, size, header_len)
    if detail.startswith("invalid offset for tensor"):
        name = detail.removeprefix("invalid offset for tensor").strip(" `")
        return HeaderError("bad_header", f"{path}: tensor {name}: data_offsets leave a gap before "
                           "it or overlap another tensor; safetensors stores tensors back to back")
    return HeaderError("bad_header", f"{path}: safetensors refuses its header ({detail})")


def _data_extents(path: Path, header_len: int) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, begin, end) from the raw header, which safe_open has parsed already."""
    with path.open("rb") as f:
        f.seek(8)
        entries = json.loads(f.read(header_len))
    return {name: (e["dtype"], e["shape"], *e["data_offsets"]) for name, e in entries.items()
            if name != "__metadata__"}


def _span_refusal(path: Path, header_len: int) -> HeaderError:
    for name, (dtype, shape, begin, end) in _data_extents(path, header_len).items():
        needed = -(-math.prod(shape) * DTYPE_BITS[dtype] // 8)
        if end - begin != needed:
            return HeaderError("bad_header", f"{path}: tensor {name}: data_offsets span "
                               f"{end - begin:,} bytes, but {dtype} {shape} needs {needed:,}")
    return HeaderError("bad_header", f"{path}: a tensor's data_offsets do not fit its dtype and shape")


def _extent_refusal(path: Path, size: int, header_len: int) -> HeaderError:
    ends = {name: end for name, (*_, end) in _data_extents(path, header_len).items()}
    data_size = size - 8 - header_len
    beyond = [name for name, end in ends.items() if end > data_size]
    if beyond:
        last = max(beyond, key=ends.get)
        return HeaderError("truncated", f"{path}: {len(beyond)} tensor(s) end past the end of the "
                           f"file, e.g. {last} ends at byte {8 + header_len + ends[last]:,} of a "
                           f"{size:,}-byte file: the file is truncated")
    covered = max(ends.values(), default=0)
    return HeaderError("bad_header", f"{path}: {data_size - covered:,} bytes after the last "
                       f"tensor's data: the header covers {covered:,} of the file's {data_size:,} "
                       "data bytes, and safetensors refuses a file it does not cover exactly")
