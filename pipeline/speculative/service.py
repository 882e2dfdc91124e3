"""What the DraftService does with one draft step, without Ray: `DraftCore`.

`step` applies a batch message from the proposer (format in `moonserve.pipeline.speculative.wire`) to the
`DraftSessions` of the active drafter and returns the reply; `prefetch` then drafts each answered
row's next step in advance (see `moonserve.pipeline.speculative.sessions`). Both are synchronous and must be
called from one thread: the deployment runs them on a single worker thread, `step` first.

Example:
    >>> core = DraftCore({"ngram": lambda: NgramDrafter(min_n=1, max_n=2)}, "ngram")
    >>> core.step({"seq": 3, "k": 2, "rows": [["r1", 0, [4, 5, 6, 4]]], "release": []})[0]
    {'seq': 3, 'drafts': [[5, 6]], 'resend_from': [-1], 'error': None}
"""

from __future__ import annotations

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


class DraftCore:
    """The active drafter's sessions; `set_drafter` switches drafters (and drops all sessions)."""

    def __init__(self, drafters: dict[str, Callable[[], Drafter]], active: str,
                 limits: SessionLimits | None = None, prefetch: bool = True,
                 adaptive: AdaptivePolicy | None = None):
        self.factories = drafters
        self.limits = limits or SessionLimits()
        self.adaptive = adaptive or AdaptivePolicy()
        self.prefetch_enabled = prefetch
        self.loaded: dict[str, Drafter] = {}
        # Set: replies tell the proposer to wait this long from now on (None: its configured one).
        self.deadline_ms: float | None = None
        self.accepted: list[int] = []
        self.to_prefetch: list[str] = []
        self.set_drafter(active)

    def set_drafter(self, name: str, adaptive: AdaptivePolicy | None = None) -> None:
        """Switch to drafter `name` (and to `adaptive`, when given)."""
        if name not in self.factories:
            raise ValueError(f"unknown drafter {name!r}; this service has {sorted(self.factories)}")
        if name not in self.loaded:  # built on first use (a DSpark drafter loads weights)
            self.loaded[name] = self.factories[name]()
        self.active = name
        self.adaptive = adaptive or self.adaptive
        self.sessions = DraftSessions(self.loaded[name], self.limits, adaptive=self.adaptive,
                                      on_verified=self.accepted.append)

    def step(self, message: dict) -> tuple[dict, StepObservation]:
        start = time.perf_counter()
        sessions, stats = self.sessions, self.sessions.stats
        hits, misses = stats.num_prefetch_hits, stats.num_prefetch_misses
        for request_id in message.get("release", ()):
            sessions.release(request_id)
        k = int(message["k"])
        observation = StepObservation(self.active, 0.0)
        drafts, resend_from = [], []
        self.to_prefetch = []
        for request_id, position, new_token_ids in message["rows"]:
            row, resend = self._draft_row(request_id, new_token_ids, position, k)
            drafts.append(row)
            resend_from.append(resend)
            observation.num_drafts.append(len(row))
            observation.num_resends += resend >= 0
            if row:
                self.to_prefetch.append(request_id)
        observation.accepted, self.accepted[:] = list(self.accepted), []
        observation.prefetch_hits = stats.num_prefetch_hits - hits
        observation.prefetch_misses = stats.num_prefetch_misses - misses
        observation.seconds = time.perf_counter() - start
        reply = {"seq": message.get("seq"), "drafts": drafts, "resend_from": resend_from,
                 "error": None}
        if self.deadline_ms is not None:
            reply["deadline_ms"] = self.deadline_ms
        return reply, observation

    def _draft_row(self, request_id: str, new_token_ids, position: int,
                   k: int) -> tuple[list[int], int]:
        """(drafts, -1), or ([], where to resend from) when the service lacks the context."""
        try:
            return self.sessions.draft(request_id, new_token_ids, position, k), -1
        except (MissingTokensError, UnknownRequestError) as e:
            return [], getattr(e, "num_tokens_held", 0)
        except ContextTooLongError:
            return [], -1

    def prefetch(self) -> int:
        """Prefetch the rows the last `step` answered with drafts; returns how many."""
        if not self.prefetch_enabled:
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
        return {"drafter": self.active, "num_sessions": self.sessions.num_sessions,
                "num_total_tokens": self.sessions.num_total_tokens, **vars(s)}
