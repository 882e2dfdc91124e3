"""What the DraftService does with one draft step, without Ray: `DraftCore`.

`step` applies a batch message from the proposer (format in `moonserve.pipeline.speculative.wire`) to the
`DraftSessions` of the active drafter and returns the reply; `prefetch` then drafts each answered
row's next step in advance (see `moonserve.pipeline.speculative.sessions`). Both are synchronous and must be
called from one thread: the deployment runs them on a single worker thread, `step` first.

Example:
    >>> core = DraftCore({"ngram": lambda: NgramDrafter(min_n=1, max_n=2)}, "ngram")
    >>> core.step({"seq": 3, "k": 2, "rows": [["r1", 0, [4, 5, 6, 4]]], "release": []})[0]
    {'seq': 3, 'drafts': [[5, 6]], 'resend_from': [-1], 'quiet': [0], 'error': None}
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.drafter import Drafter
from moonserve.pipeline.speculative.sessions import (
    ContextTooLongError,
    DraftSessionError,
    DraftSessions,
    MissingTokensError,
    SessionLimits,
    UnknownRequestError,
)


@dataclass
class StepObservation:
    """What one step did, for the service's metrics."""

    drafter: str
    seconds: float
    num_drafts: list[int] = field(default_factory=list)  # draft tokens per answered row
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verified row
    num_resends: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    min_acceptance: float = 0.0  # the step's threshold (the engine's load, else the configured)


class DraftCore:
    """The active drafter's sessions; `set_drafter` switches drafters and starts the new one
    afresh (no sessions, no cache of earlier requests). `drafters` are factories; one that loads
    weights loads them once (`deployments.draft.drafter_factories`)."""

    def __init__(self, drafters: dict[str, Callable[[], Drafter]], active: str,
                 limits: SessionLimits | None = None, prefetch: bool = True,
                 adaptive: AdaptivePolicy | None = None):
        self.factories = drafters
        self.limits = limits or SessionLimits()
        self.adaptive = adaptive or AdaptivePolicy()
        self.prefetch_enabled = prefetch
        # Set: replies tell the proposer to wait this long from now on (None: its configured one).
        self.deadline_ms: float | None = None
        self.accepted: list[int] = []
        self.to_prefetch: list[str] = []
        self.num_context_rows = 0  # hidden-state rows received (dspark_context)
        self.set_drafter(active)

    def set_drafter(self, name: str, adaptive: AdaptivePolicy | None = None,
                    settings: dict | None = None, prefetch: bool | None = None) -> None:
        """Switch to a new drafter `name` (and to `adaptive` and `prefetch`, when given), made
        with `settings` when given (keyword arguments of its factory: the `suffix` drafter takes
        fields of `draft.suffix`)."""
        if name not in self.factories:
            raise ValueError(f"unknown drafter {name!r}; this service has {sorted(self.factories)}")
        factory = self.factories[name]
        if settings:  # asked of the factory's signature: a TypeError inside it stays one
            try:
                inspect.signature(factory).bind(**settings)
            except TypeError as exc:
                raise ValueError(f"drafter {name!r} takes no settings {sorted(settings)}") from exc
        drafter = factory(**(settings or {}))  # a new one: no cache of earlier requests
        self.active = name
        self.adaptive = adaptive or self.adaptive
        if prefetch is not None:
            self.prefetch_enabled = prefetch
        self.sessions = DraftSessions(drafter, self.limits, adaptive=self.adaptive,
                                      on_verified=self.accepted.append)

    def step(self, message: dict) -> tuple[dict, StepObservation]:
        start = time.perf_counter()
        sessions, stats = self.sessions, self.sessions.stats
        hits, misses = stats.num_prefetch_hits, stats.num_prefetch_misses
        for request_id in message.get("release", ()):
            sessions.release(request_id)
        k = int(message["k"])
        sessions.min_acceptance = message.get("min_acceptance")
        observation = StepObservation(self.active, 0.0, min_acceptance=sessions.threshold)
        self.to_prefetch = []
        drafts, resend_from, quiet = self._draft_rows(message, k)
        for request_id, row, resend in zip((r[0] for r in message["rows"]), drafts, resend_from,
                                           strict=True):
            observation.num_drafts.append(len(row))
            observation.num_resends += resend >= 0
            if row:
                self.to_prefetch.append(request_id)
        observation.accepted, self.accepted[:] = list(self.accepted), []
        observation.prefetch_hits = stats.num_prefetch_hits - hits
        observation.prefetch_misses = stats.num_prefetch_misses - misses
        observation.seconds = time.perf_counter() - start
        reply = {"seq": message.get("seq"), "drafts": drafts, "resend_from": resend_from,
                 "quiet": quiet, "error": None}
        if self.deadline_ms is not None:
            reply["deadline_ms"] = self.deadline_ms
        return reply, observation

    def _draft_rows(self, message: dict,
                    k: int) -> tuple[list[list[int]], list[int], list[int]]:
        """Per row: drafts; -1 or the position to resend from (the service lacks the context);
        and the steps its request will draft nothing for (its adaptive pause, which the proposer
        then skips). Every row's context first, then every proposal (one pass for a batched
        drafter)."""
        rows = message["rows"]
        drafts: list[list[int]] = [[] for _ in rows]
        resend_from = [-1] * len(rows)
        quiet = [0] * len(rows)
        answered, contexts = [], []
        for i, (request_id, position, new_token_ids, *hidden) in enumerate(rows):
            try:
                self.sessions.extend(request_id, new_token_ids, position)
            except (MissingTokensError, UnknownRequestError) as e:
                resend_from[i] = getattr(e, "num_tokens_held", 0)
                continue
            except ContextTooLongError:
                continue
            context = self._context(request_id, *hidden, message.get("hidden_dtype"))
            if isinstance(context, int):
                resend_from[i] = context
                continue
            if context is not None:
                contexts.append(context)
            answered.append(i)
        if contexts:
            self.sessions.drafter.add_contexts(contexts)
            self.num_context_rows += sum(int(states.shape[0]) for _, _, states in contexts)
        proposals = self.sessions.propose_many([rows[i][0] for i in answered], k)
        for i, proposal in zip(answered, proposals, strict=True):
            if proposal is None:  # evicted by a later row of this step: start it over
                resend_from[i] = 0
            elif proposal:
                drafts[i] = proposal
            else:
                quiet[i] = self.sessions.take_pause(rows[i][0])
        return drafts, resend_from, quiet

    def _context(self, request_id: str, start: int = -1, hidden: bytes = b"",
                 dtype: str | None = None):
        """The row's hidden states as `(state, start, [m, context_width])` for a drafter over
        them; None when there are none (or the drafter reads tokens only); an int: the row's
        hidden states start past the service's context, resend from that token position."""
        drafter = self.sessions.drafter
        if not hidden or not hasattr(drafter, "add_contexts"):
            return None
        state = self.sessions.state(request_id)
        if start < 0 or start > state.num_context:
            return min(len(state.token_ids), state.num_context + 1)
        return state, start, decode_hidden(hidden, dtype or "bfloat16",
                                           drafter.config.context_width)

    def prefetch(self) -> int:
        """Prefetch the rows the last `step` answered with drafts; returns how many."""
        if not self.prefetch_enabled or not getattr(self.sessions.drafter, "prefetch", True):
            return 0
        done = 0
        for request_id in self.to_prefetch:
            try:
                done += self.sessions.prefetch(request_id)
            except DraftSessionError:
                continue
        self.to_prefetch = []
        return done

    def evict_idle(self) -> int:
        return len(self.sessions.evict_idle())

    def summary(self) -> dict:
        s = self.sessions.stats
        return {"drafter": self.active, "min_acceptance": self.sessions.threshold,
                "num_sessions": self.sessions.num_sessions,
                "num_total_tokens": self.sessions.num_total_tokens,
                "num_context_rows": self.num_context_rows, **vars(s)}


HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


def decode_hidden(hidden: bytes, dtype: str, width: int):
    """A row's `hidden` bytes as a `[m, width]` tensor of `dtype`."""
    import torch

    if dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {dtype!r}")
    values = torch.frombuffer(bytearray(hidden), dtype=getattr(torch, dtype))
    if values.numel() % width:
        raise ValueError(f"hidden: {values.numel()} {dtype} values are not whole rows of the "
                         f"drafter's context_width {width}")
    return values.view(-1, width)
