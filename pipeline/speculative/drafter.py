"""The pluggable drafter interface used by `DraftSessions`.

A `Drafter` is stateless configuration (thresholds, weights); it opens one `DrafterState` per
request, which owns that request's token context and any cache derived from it (the n-gram index
now, the DSpark drafter's KV cache later). `DraftSessions` only ever calls the five members below,
so a new drafter needs nothing else.

Example:
    >>> from moonserve.pipeline.speculative.ngram import NgramDrafter
    >>> state = NgramDrafter(min_n=2, max_n=3).new_state("req-1")
    >>> state.append([7, 8, 9, 7, 8])
    >>> state.propose(num_speculative_tokens=2)
    [9, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class DrafterState(Protocol):
    """One request's drafting context: its accepted token ids plus derived caches."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The context, `[num_tokens]`; read-only to callers."""
        ...

    def append(self, token_ids: Sequence[int]) -> None:
        """Extend the context at its end."""
        ...

    def truncate(self, num_tokens: int) -> None:
        """Drop every token from index `num_tokens` on (rejected or diverged tail)."""
        ...

    def propose(self, num_speculative_tokens: int) -> list[int]:
        """Up to `num_speculative_tokens` draft ids to follow the context (may be empty)."""
        ...

    def propose_after(self, assumed: Sequence[int], num_speculative_tokens: int) -> list[int]:
        """`propose` for the context plus `assumed` (the service's prefetch: the drafts just
        sent, as if accepted), leaving the context as it was."""
        ...


def propose_by_appending(state: DrafterState, assumed: Sequence[int],
                         num_speculative_tokens: int) -> list[int]:
    """`propose_after` for a state whose `truncate` of a short tail is cheap: append, propose,
    truncate."""
    num_tokens = len(state.token_ids)
    state.append(assumed)
    try:
        return state.propose(num_speculative_tokens)
    finally:
        state.truncate(num_tokens)


@runtime_checkable
class Drafter(Protocol):
    """A factory of per-request drafting states."""

    name: str

    def new_state(self, request_id: str) -> DrafterState:
        """Open an empty context for `request_id`."""
        ...


class NoDrafts:
    """A context that never proposes: speculation paused without restarting the engine."""

    def __init__(self):
        self._token_ids: list[int] = []

    @property
    def token_ids(self) -> Sequence[int]:
        return self._token_ids

    def append(self, token_ids: Sequence[int]) -> None:
        self._token_ids.extend(token_ids)

    def truncate(self, num_tokens: int) -> None:
        del self._token_ids[num_tokens:]

    def propose(self, num_speculative_tokens: int) -> list[int]:
        return []

    def propose_after(self, assumed: Sequence[int], num_speculative_tokens: int) -> list[int]:
        return []


class NoDrafter:
    """`DraftService.set_drafter("none")`: every step drafts nothing (decode as without speculation)."""

    name = "none"

    def new_state(self, request_id: str) -> NoDrafts:
        return NoDrafts()
