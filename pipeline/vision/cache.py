"""A byte-bounded LRU of encoder outputs, keyed by the SHA-256 of the image bytes.

The LRU itself is `cachetools.LRUCache`, sized in bytes (`getsizeof` is each array's `nbytes`);
this class adds the hit/miss counts the encoder's metrics and stats report.

Example:
    >>> cache = EmbeddingCache(max_bytes=1 << 20)
    >>> cache.put("ab12", array)          # array: np.ndarray [num_tokens, hidden]
    >>> cache.get("ab12") is array
    True
"""

from __future__ import annotations

import cachetools
import numpy as np


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: cachetools.LRUCache[str, np.ndarray] = cachetools.LRUCache(
            maxsize=max_bytes, getsizeof=lambda value: value.nbytes)
        self.hits = 0
        self.misses = 0

    @property
    def bytes(self) -> int:
        return self.entries.currsize

    def get(self, key: str) -> np.ndarray | None:
        value = self.entries.get(key)  # a hit becomes the most recent
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        """Insert (most recent); evicts the least recently used until within `max_bytes`.
        A value larger than the whole cache is not kept (nor the old value under its key)."""
        self.entries.pop(key, None)
        if value.nbytes <= self.max_bytes:  # else LRUCache raises "value too large"
            self.entries[key] = value

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self.entries),
                "bytes": self.bytes}
