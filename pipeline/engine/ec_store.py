"""The encoder-cache store: one file per image's encoder output in node-local memory.

What the VisionEncoder's and the LanguageModel's vLLM engines exchange through
`MoonserveECConnector` (`pipeline/engine/ec_connector.py`), and what the replicas themselves read
and write. No vLLM import: a Ray task that reads an entry on another node
(`fetch_from`) starts without loading vLLM.

Store layout: `<store>/<key>/encoder_cache.safetensors`, one tensor `ec_cache`
[num_image_tokens, text_hidden_size] in the engine's dtype; the file's mtime is its last use.

API (all that other modules should use):

- `DEFAULT_STORE`: `/dev/shm/moonserve-ec`.
- `store_path(store, key) -> Path`: the file of one entry.
- `put(store, key, tensor) -> Path`: write an entry atomically (temp file + rename).
- `has(store, key) -> bool`; `get(store, key, device="cpu") -> Tensor` (marks the entry used);
  `num_rows(store, key) -> int` (its first dimension, from the file's header; marks it used).
- `touch(path) -> bool`: mark an entry used.
- `evict(store, max_bytes, keep_newer_than_s=60.0) -> list[str]`: drop least recently used
  entries until the store holds at most `max_bytes`; entries used in the last `keep_newer_than_s`
  stay (a consumer's scheduler may have promised them to its worker).
- `fetch_from(node_id, store, key) -> Tensor`: an entry of another node's store, read there by a
  Ray task pinned to that node and sent through Ray's object store.

Example:
    >>> import tempfile, torch
    >>> store = Path(tempfile.mkdtemp())
    >>> _ = put(store, "img-1", torch.ones(9, 256, dtype=torch.bfloat16))
    >>> has(store, "img-1"), get(store, "img-1").shape, num_rows(store, "img-1"), has(store, "img-2")
    (True, torch.Size([9, 256]), 9, False)
    >>> evict(store, max_bytes=0, keep_newer_than_s=0)
    ['img-1']
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import safetensors
import safetensors.torch
import torch

DEFAULT_STORE = Path("/dev/shm/moonserve-ec")
ENTRY_FILE = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"  # the name vLLM's ECExampleConnector.start_load_caches reads


def store_path(store: str | Path, key: str) -> Path:
    """`<store>/<key>/encoder_cache.safetensors`; the key must be one path component."""
    if not key or key in (".", "..") or "/" in key or "\0" in key:
        raise ValueError(f"encoder cache key {key!r} is not a valid file name "
                         "(no '/', not '.' or '..')")
    return Path(store) / key / ENTRY_FILE


def put(store: str | Path, key: str, tensor: torch.Tensor) -> Path:
    """Write `tensor` [num_tokens, hidden] under `key`: a temp file beside the entry, renamed."""
    path = store_path(store, key)
    tmp = temp_file(path.parent)
    try:
        safetensors.torch.save_file({TENSOR_NAME: tensor.detach().cpu().contiguous()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def temp_file(folder: Path) -> str:
    for attempt in range(2):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
        except FileNotFoundError:  # `evict` removed the folder between mkdir and mkstemp
            if attempt:
                raise
            continue
        os.close(fd)
        return tmp


def has(store: str | Path, key: str) -> bool:
    return store_path(store, key).is_file()


def get(store: str | Path, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor under `key` (FileNotFoundError if there is none); marks the entry used."""
    path = store_path(store, key)
    tensor = safetensors.torch.load_file(path, device=str(device))[TENSOR_NAME]
    touch(path)
    return tensor


def num_rows(store: str | Path, key: str) -> int:
    """The entry's [num_tokens, hidden] first dimension, read from its header only (no tensor
    data); marks the entry used. FileNotFoundError if there is none."""
    path = store_path(store, key)
    with safetensors.safe_open(path, framework="pt") as entry:
        rows = entry.get_slice(TENSOR_NAME).get_shape()[0]
    touch(path)
    return rows


_remote_get = None


def fetch_from(node_id: str, store: str | Path, key: str) -> torch.Tensor:
    """`get(store, key)` run on the node `node_id` (where the entry is, in that node's shared
    memory), its tensor sent here through Ray's object store: the only way an encoder output
    crosses nodes. Raises what `get` raised there (FileNotFoundError: evicted meanwhile)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    global _remote_get
    if _remote_get is None:
        _remote_get = ray.remote(num_cpus=0, max_retries=0)(get)
    task = _remote_get.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id,
                                                                                   soft=False))
    return ray.get(task.remote(str(store), key))


def touch(path: Path) -> bool:
    """Mark an entry used now (its LRU time); False if it does not exist."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def evict(store: str | Path, max_bytes: int, keep_newer_than_s: float = 60.0) -> list[str]:
    """Remove least recently used entries until the store's entries total <= `max_bytes`."""
    entries = []  # (mtime, size, path)
    for path in Path(store).glob(f"*/{ENTRY_FILE}"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue  # evicted by another process meanwhile
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    cutoff = time.time() - keep_newer_than_s
    evicted = []
    for mtime, size, path in sorted(entries):
        if total <= max_bytes or mtime > cutoff:
            break
        path.unlink(missing_ok=True)
        remove_empty_dir(path.parent)
        total -= size
        evicted.append(path.parent.name)
    return evicted


def remove_empty_dir(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass  # a writer's temp file is in it, or it is gone already
