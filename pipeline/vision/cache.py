"""A byte-bounded LRU of encoder outputs, keyed by the SHA-256 of the image bytes.

Example:
    >>> cache = EmbeddingCache(max_bytes=1 << 20)
    >>> cache.put("ab12", array)          # array: np.ndarray [num_tokens, hidden]
    >>> cache.get("ab12") is array
    True
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> np.ndarray | None:
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        """Insert (most recent); evicts the least recently used until within `max_bytes`.
        A value larger than the whole cache is not kept."""
        if key in self.entries:
            self.bytes -= self.entries.pop(key).nbytes
        if value.nbytes > self.max_bytes:
            return
        self.entries[key] = value
        self.bytes += value.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self.entries),
                "bytes": self.bytes}
