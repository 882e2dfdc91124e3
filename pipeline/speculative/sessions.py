"""Per-request draft state of the DraftService, bounded in sessions, tokens and idle time.

The target sends, per request and step, only the tokens added since its last call:
`draft(request_id, new_token_ids, position, num_speculative_tokens)`, where `position` is the
number of context tokens the target believes the service already holds. The service's context
becomes `context[:position] + new_token_ids`:

- `position == held`: plain append (the common case, one to k+1 tokens per step).
- `position < held`: a resend after rejected drafts (the service had assumed drafts accepted) or a
  duplicate call from another tensor-parallel rank. Only the tail that differs is dropped, so a
  duplicate is a no-op and keeps the cached proposal.
- `position > held`: tokens are missing (a lost call, or the session was evicted): raises
  `MissingTokensError`; resend from `error.num_tokens_held` (or from 0, which always works).

Proposals are cached per (context length, num_speculative_tokens) until the context changes, so
every rank asking at the same position gets the same drafts, even from a sampling drafter.

`num_speculative_tokens` is the most a proposal may hold: each session drafts as many as its
acceptance so far makes worth it, maybe none (`moonserve.pipeline.speculative.adaptive`).

Prefetch (PEARL's post-verify idea): after answering a step, `prefetch` drafts k + 1 tokens past
the context PLUS the drafts just returned, as if the target accepts them all; the first of those
k + 1 guesses the target's bonus token. When the next call brings exactly drafts + that bonus, the
remaining k are the answer without drafting on the critical path (`stats.num_prefetch_hits`).

Methods are synchronous and not thread-safe: call them from one thread (the replica's loop).

Example:
    >>> from moonserve.pipeline.speculative.ngram import NgramDrafter
    >>> sessions = DraftSessions(NgramDrafter(min_n=1, max_n=2), adaptive=AdaptivePolicy(False))
    >>> sessions.draft("req-1", [4, 5, 6, 4], position=0, num_speculative_tokens=2)
    [5, 6]
    >>> sessions.draft("req-1", [5, 9], position=4, num_speculative_tokens=2)  # 5 accepted, 9 bonus
    []
    >>> sessions.release("req-1")
    True
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ConfigDict, Field, PositiveFloat, PositiveInt
from pydantic.dataclasses import dataclass as pydantic_dataclass

from moonserve.pipeline.speculative.adaptive import Acceptance, AdaptivePolicy
from moonserve.pipeline.speculative.drafter import Drafter, DrafterState


class DraftSessionError(Exception):
    """Base of the errors a DraftService caller is expected to handle."""


class MissingTokensError(DraftSessionError):
    """The caller's `position` is past what the service holds for the request."""

    def __init__(self, request_id: str, position: int, num_tokens_held: int):
        self.request_id = request_id
        self.position = position
        self.num_tokens_held = num_tokens_held
        super().__init__(
            f"request {request_id!r}: position {position} is past the {num_tokens_held} tokens "
            f"the draft service holds; resend its context from position {num_tokens_held} (or 0)"
        )


class UnknownRequestError(DraftSessionError):
    """No session for the request (never opened, released, or evicted)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(
            f"request {request_id!r} has no draft session (released or evicted); "
            "resend its full context from position 0"
        )


class ContextTooLongError(DraftSessionError):
    """One request's context alone exceeds the service's total token budget."""

    def __init__(self, request_id: str, num_tokens: int, max_total_tokens: int):
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.max_total_tokens = max_total_tokens
        super().__init__(
            f"request {request_id!r}: context of {num_tokens} tokens exceeds the draft service's "
            f"max_total_tokens={max_total_tokens}; draft this request without the service"
        )


# A pydantic dataclass: the app config validates `draft.sessions` as this class, so each field,
# default and bound is written once; unknown keys fail naming the key.
@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class SessionLimits:
    """Bounds on the service's memory; the least recently used session goes first."""

    max_sessions: PositiveInt = Field(1024, description=(
        "Request contexts one DraftService replica holds; past it the least recently used goes."))
    max_total_tokens: PositiveInt = Field(4_000_000, description=(
        "Tokens of all held contexts together, least recently used dropped past it; a request "
        "whose context alone is longer gets no drafts from the service."))
    idle_timeout_s: PositiveFloat = Field(300.0, description=(
        "A context unused this long is dropped (the replica checks every few seconds)."))


@dataclass
class SessionStats:
    """Counters for the service's metrics."""

    num_opened: int = 0
    num_released: int = 0
    num_evicted_lru: int = 0
    num_evicted_idle: int = 0
    num_proposals: int = 0
    num_paused: int = 0  # proposals left empty: the session's acceptance made no draft worth it
    num_cached_proposals: int = 0
    num_truncations: int = 0
    num_prefetches: int = 0
    num_prefetch_hits: int = 0
    num_prefetch_misses: int = 0


@dataclass(frozen=True)
class Prefetch:
    """Drafts for the context `context[:num_tokens] + assumed + proposal[:1]`."""

    num_tokens: int
    assumed: tuple[int, ...]
    proposal: tuple[int, ...]  # k + 1 tokens: the bonus guess, then the next step's drafts

    def answers(self, token_ids: Sequence[int]) -> bool:
        expected = (*self.assumed, *self.proposal[:1])
        return len(self.proposal) > 1 and len(token_ids) == self.num_tokens + len(expected) and \
            tuple(token_ids[self.num_tokens:]) == expected


@dataclass
class DraftSession:
    request_id: str
    state: DrafterState
    last_used: float
    # (num_tokens, num_speculative_tokens, draft_token_ids) of the last proposal
    cached_proposal: tuple[int, int, list[int]] | None = None
    prefetched: Prefetch | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)

    @property
    def num_tokens(self) -> int:
        return len(self.state.token_ids)


@dataclass
class DraftSessions:
    """Bounded map request_id -> `DraftSession`, in least-recently-used order."""

    drafter: Drafter
    limits: SessionLimits = field(default_factory=SessionLimits)
    clock: Callable[[], float] = time.monotonic
    stats: SessionStats = field(default_factory=SessionStats)
    adaptive: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    # Called with the number of a proposal's drafts the next call's tokens confirm.
    on_verified: Callable[[int], None] | None = None
    # This step's acceptance threshold from the engine's load (None: `adaptive.min_acceptance`).
    min_acceptance: float | None = None
    _sessions: OrderedDict[str, DraftSession] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    _num_total_tokens: int = field(default=0, init=False)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_total_tokens(self) -> int:
        return self._num_total_tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    @property
    def threshold(self) -> float:
        """The acceptance a draft needs this step: the engine's, else `adaptive.min_acceptance`."""
        return self.adaptive.min_acceptance if self.min_acceptance is None else \
            self.min_acceptance

    def num_tokens(self, request_id: str) -> int:
        """Tokens held for `request_id`; 0 when it has no session."""
        session = self._sessions.get(request_id)
        return session.num_tokens if session else 0

    def draft(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        position: int,
        num_speculative_tokens: int,
    ) -> list[int]:
        """`extend` then `propose`: the DraftService's per-step call."""
        self.extend(request_id, new_token_ids, position)
        return self.propose(request_id, num_speculative_tokens)

    def extend(
        self, request_id: str, new_token_ids: Sequence[int], position: int
    ) -> int:
        """Make the context `context[:position] + new_token_ids`; returns its length.

        Opens the session when `request_id` is new (then `position` must be 0).
        """
        held = self.num_tokens(request_id)
        if position < 0 or position > held:
            raise MissingTokensError(request_id, position, held)
        if position + len(new_token_ids) > self.limits.max_total_tokens:
            self.release(request_id)
            raise ContextTooLongError(
                request_id, position + len(new_token_ids), self.limits.max_total_tokens
            )
        session = self._sessions.get(request_id) or self._open(request_id)
        self._observe_verification(session, new_token_ids, position)
        self._apply(session, new_token_ids, position)
        self._touch(session)
        self._enforce_limits(keep=request_id)
        return session.num_tokens

    def propose(self, request_id: str, num_speculative_tokens: int) -> list[int]:
        """Up to `num_speculative_tokens` drafts for the current context (as many as the
        session's acceptance makes worth it); idempotent."""
        session = self._sessions.get(request_id)
        if session is None:
            raise UnknownRequestError(request_id)
        known = self._known_proposal(session, num_speculative_tokens)
        if known is not None:
            return known
        session.cached_proposal = (session.num_tokens, num_speculative_tokens,
                                   self._new_proposal(session, num_speculative_tokens))
        return list(session.cached_proposal[2])

    def propose_many(self, request_ids: Sequence[str],
                     num_speculative_tokens: int) -> list[list[int] | None]:
        """`propose` for each request (None where it has no session). A batched drafter
        (`drafter.batched`, e.g. `ContextDSparkDrafter`) drafts every new proposal in ONE
        `propose_batch` call of block size `num_speculative_tokens`; each request keeps as many
        of its block's drafts as its acceptance makes worth it."""
        if not getattr(self.drafter, "batched", False):
            return [self.propose(r, num_speculative_tokens) if r in self._sessions else None
                    for r in request_ids]
        results: list[list[int] | None] = [None] * len(request_ids)
        pending: list[tuple[int, DraftSession, int]] = []
        for i, request_id in enumerate(request_ids):
            session = self._sessions.get(request_id)
            if session is None:
                continue
            results[i] = self._known_proposal(session, num_speculative_tokens)
            if results[i] is None:
                k = self._depth(session, num_speculative_tokens)
                if k == 0:
                    session.cached_proposal = (session.num_tokens, num_speculative_tokens, [])
                    results[i] = []
                else:
                    pending.append((i, session, k))
        if pending:
            blocks = self.drafter.propose_batch([s.state for _, s, _ in pending],
                                                num_speculative_tokens)
            self.stats.num_proposals += len(pending)
            for (i, session, k), block in zip(pending, blocks, strict=True):
                session.cached_proposal = (session.num_tokens, num_speculative_tokens, block[:k])
                results[i] = list(block[:k])
        return results

    def take_pause(self, request_id: str) -> int:
        """Steps the request will draft nothing for (its adaptive pause), handed to the caller,
        which leaves the request out of that many steps; 0 when it is not paused."""
        session = self._sessions.get(request_id)
        return session.acceptance.take_pause() if session else 0

    def state(self, request_id: str) -> DrafterState | None:
        """The request's drafter state (None without a session)."""
        session = self._sessions.get(request_id)
        return session.state if session else None

    def _known_proposal(self, session: DraftSession,
                        num_speculative_tokens: int) -> list[int] | None:
        """The session's proposal for its current context, when it already made one (the call
        is idempotent); None when a new one is due."""
        self._touch(session)
        proposal = session.cached_proposal
        if proposal is None or proposal[:2] != (session.num_tokens, num_speculative_tokens):
            return None
        self.stats.num_cached_proposals += 1
        return list(proposal[2])

    def _depth(self, session: DraftSession, num_speculative_tokens: int) -> int:
        """How many tokens the session's acceptance makes worth drafting now (0: paused)."""
        k = session.acceptance.num_drafts(num_speculative_tokens, self.adaptive, self.threshold)
        if k == 0:
            session.prefetched = None
            self.stats.num_paused += 1
        return k

    def _new_proposal(self, session: DraftSession, num_speculative_tokens: int) -> list[int]:
        k = self._depth(session, num_speculative_tokens)
        if k == 0:
            return []
        drafts = self._take_prefetch(session, k)
        if drafts is None:
            drafts = list(session.state.propose(k))
            self.stats.num_proposals += 1
        return drafts

    def prefetch(self, request_id: str) -> bool:
        """Draft the step after the last proposal, assuming all its drafts get accepted (k + 1
        tokens for the proposal's k = `num_speculative_tokens`, the most the next step may take).

        False when there is nothing to prefetch (no session, no drafts, already prefetched).
        """
        session = self._sessions.get(request_id)
        if session is None or not session.cached_proposal or not session.cached_proposal[2]:
            return False
        num_tokens, k, assumed = session.cached_proposal
        if num_tokens != session.num_tokens or (
                session.prefetched is not None and session.prefetched.num_tokens == num_tokens):
            return False
        proposal = tuple(session.state.propose_after(assumed, k + 1))
        session.prefetched = Prefetch(num_tokens, tuple(assumed), proposal)
        self.stats.num_prefetches += 1
        return True

    def _take_prefetch(self, session: DraftSession, k: int) -> list[int] | None:
        prefetched, session.prefetched = session.prefetched, None
        if prefetched is None:
            return None
        if prefetched.answers(session.state.token_ids):
            self.stats.num_prefetch_hits += 1
            return list(prefetched.proposal[1:1 + k])
        self.stats.num_prefetch_misses += 1
        return None

    def _observe_verification(self, session: DraftSession, new_token_ids: Sequence[int],
                              position: int) -> None:
        proposal = session.cached_proposal
        if proposal is None or not proposal[2] or proposal[0] != position or \
                position != session.num_tokens or not new_token_ids:
            return
        # The target sends its accepted drafts, then one token of its own.
        accepted = _common_prefix_len(proposal[2], 0, new_token_ids[:-1])
        session.acceptance.observe(len(proposal[2]), accepted, self.adaptive)
        if self.on_verified is not None:
            self.on_verified(accepted)

    def release(self, request_id: str) -> bool:
        """Forget a finished or aborted request; False when it had no session."""
        if self._drop(request_id) is None:
            return False
        self.stats.num_released += 1
        return True

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Drop sessions unused for more than `idle_timeout_s`; returns their request ids."""
        now = self.clock() if now is None else now
        idle = [
            request_id
            for request_id, session in self._sessions.items()
            if now - session.last_used > self.limits.idle_timeout_s
        ]
        for request_id in idle:
            self._drop(request_id)
        self.stats.num_evicted_idle += len(idle)
        return idle

    def _open(self, request_id: str) -> DraftSession:
        session = DraftSession(
            request_id, self.drafter.new_state(request_id), self.clock()
        )
        self._sessions[request_id] = session
        self.stats.num_opened += 1
        return session

    def _apply(
        self, session: DraftSession, new_token_ids: Sequence[int], position: int
    ) -> None:
        held = session.num_tokens
        common = _common_prefix_len(session.state.token_ids, position, new_token_ids)
        keep = position + common
        if keep < held:
            session.state.truncate(keep)
            self.stats.num_truncations += 1
        if common < len(new_token_ids):
            session.state.append(new_token_ids[common:])
        if session.num_tokens != held or keep < held:
            session.cached_proposal = None
        self._num_total_tokens += session.num_tokens - held

    def _touch(self, session: DraftSession) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.request_id)

    def _enforce_limits(self, keep: str) -> None:
        while self._over_limits() and len(self._sessions) > 1:
            oldest = next(iter(self._sessions))
            if oldest == keep:  # keep is most recent after _touch; defensive only
                break
            self._drop(oldest)
            self.stats.num_evicted_lru += 1

    def _over_limits(self) -> bool:
        return (
            len(self._sessions) > self.limits.max_sessions
            or self._num_total_tokens > self.limits.max_total_tokens
        )

    def _drop(self, request_id: str) -> DraftSession | None:
        session = self._sessions.pop(request_id, None)
        if session is not None:
            self._num_total_tokens -= session.num_tokens
        return session


def _common_prefix_len(
    held: Sequence[int], position: int, new_token_ids: Sequence[int]
) -> int:
    """How many of `new_token_ids` already sit at `held[position:]`."""
    overlap = min(len(held) - position, len(new_token_ids))
    for i in range(overlap):
        if held[position + i] != new_token_ids[i]:
            return i
    return overlap
