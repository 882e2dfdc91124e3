"""Prompt-lookup (n-gram) drafting, model-free, with an incremental index per request.

Semantics, identical to vLLM 0.32's in-engine proposer
(`vllm/v1/spec_decode/ngram_proposer.py`, `_find_longest_matched_ngram_and_propose_tokens`):

- Let `tokens` be the context, `num_tokens = len(tokens)`. Find the LONGEST n in
  `[min_n, max_n]` such that the suffix `tokens[-n:]` also occurs earlier, i.e. at an
  occurrence ending at index <= num_tokens - 2 (overlapping the suffix is allowed).
- Among that n-gram's earlier occurrences take the EARLIEST one (vLLM's reversed-KMP scan
  updates its match on `>=`, which keeps the leftmost position), starting at `start`.
- Draft `tokens[start + n : start + n + k]`: fewer than k when the match is close to the end.
- `k` is first capped by `max_model_len - num_tokens` (when given); no draft when
  `num_tokens < min_n` or the cap is <= 0.

Note the earliest, not the most recent, occurrence: that is what vLLM does, and keeping it
means the service's `ngram` arm proposes exactly what vLLM's `method="ngram"` would.

Where this differs from vLLM: vLLM rescans the whole context every step (O(num_tokens) per
request per step, numba); here an index `n-gram -> end index of its first occurrence` is updated as
tokens are appended (O(max_n - min_n + 1) dict updates per token) and a proposal is at most
`max_n - min_n + 1` lookups, so a 100k-token history costs nothing extra per step. Truncation
(rejected drafts) removes only entries whose first occurrence lies in the dropped tail. vLLM also
skips requests with no sampled tokens this step and requests at `max_model_len`; that batch-level
filtering belongs to the caller (the custom_class proposer).

Memory: one dict entry (a tuple key of n ints plus an int) per token per n in [min_n, max_n],
roughly 100-150 bytes each in CPython; bound it with `DraftSessions`' token limit.

Example:
    >>> index = NgramIndex(min_n=2, max_n=3)
    >>> index.append([1, 2, 3, 4, 1, 2])
    >>> index.propose(num_speculative_tokens=3)
    [3, 4, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moonserve.pipeline.speculative.drafter import propose_by_appending

# vLLM's prompt_lookup_min and prompt_lookup_max when neither is configured
VLLM_DEFAULT_PROMPT_LOOKUP = 5


class NgramIndex:
    """Incremental prompt-lookup index over one request's token ids (a `DrafterState`)."""

    def __init__(self, min_n: int, max_n: int, max_model_len: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len
        self._token_ids: list[int] = []
        # n-gram (tuple of n ids) -> end index (inclusive) of its first occurrence
        self._first_end: dict[tuple[int, ...], int] = {}

    @property
    def token_ids(self) -> Sequence[int]:
        return self._token_ids

    def __len__(self) -> int:
        return len(self._token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self._token_ids.append(int(token_id))
            for key in self._ngrams_ending_at(len(self._token_ids) - 1):
                self._first_end.setdefault(key, len(self._token_ids) - 1)

    def truncate(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        for end in range(len(self._token_ids) - 1, num_tokens - 1, -1):
            for key in self._ngrams_ending_at(end):
                if self._first_end.get(key) == end:
                    del self._first_end[key]
        del self._token_ids[num_tokens:]

    def propose(self, num_speculative_tokens: int) -> list[int]:
        """Draft ids following the longest, earliest earlier match of the context's suffix."""
        num_tokens = len(self._token_ids)
        k = self._capped_k(num_speculative_tokens, num_tokens)
        if k <= 0 or num_tokens < self.min_n:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = self._first_end.get(tuple(self._token_ids[num_tokens - n :]))
            if end is not None and end <= num_tokens - 2:
                return self._token_ids[end + 1 : end + 1 + k]
        return []

    def propose_after(self, assumed: Sequence[int], num_speculative_tokens: int) -> list[int]:
        return propose_by_appending(self, assumed, num_speculative_tokens)

    def _capped_k(self, k: int, num_tokens: int) -> int:
        if self.max_model_len is None:
            return k
        return min(k, self.max_model_len - num_tokens)

    def _ngrams_ending_at(self, end: int):
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            yield tuple(self._token_ids[end - n + 1 : end + 1])


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup `Drafter`; parameters named after vLLM's `prompt_lookup_min/max`.

    Example:
        >>> state = NgramDrafter(min_n=1, max_n=2).new_state("req-1")
        >>> state.append([5, 6, 5])
        >>> state.propose(4)
        [6, 5]
    """

    min_n: int = VLLM_DEFAULT_PROMPT_LOOKUP
    max_n: int = VLLM_DEFAULT_PROMPT_LOOKUP
    max_model_len: int | None = None
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}"
            )

    def new_state(self, request_id: str) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n, self.max_model_len)


def propose_ngram(
    token_ids: Sequence[int],
    num_speculative_tokens: int,
    min_n: int = VLLM_DEFAULT_PROMPT_LOOKUP,
    max_n: int = VLLM_DEFAULT_PROMPT_LOOKUP,
    max_model_len: int | None = None,
) -> list[int]:
    """One-shot proposal over a whole context (builds a throwaway index).

    >>> propose_ngram([1, 2, 3, 1, 2], num_speculative_tokens=3, min_n=1, max_n=3)
    [3, 1, 2]
    """
    index = NgramIndex(min_n, max_n, max_model_len)
    index.append(token_ids)
    return index.propose(num_speculative_tokens)
