"""Lane admission at the Router: classify a request, then wait for a slot in its lane's queue.

Each lane has an in-flight limit toward the LanguageModel and a bounded FIFO queue in front of
it. A full queue rejects at once (429/503 + Retry-After); a request queued past the lane's
timeout gets 503; a queued request whose client goes away (its task is cancelled) leaves the queue
at once. Nothing already admitted is ever dropped: a slot is only released by its holder.

Example:
    >>> lanes = Lanes(LanesConfig())
    >>> lane = lanes.classify(num_prompt_tokens=12, hint=None)      # "interactive"
    >>> slot = await lanes.admit(lane)
    >>> try: ...                                                     # generate
    ... finally: slot.release()
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol

from moonserve.pipeline.config import LaneLimits, LanesConfig
from moonserve.pipeline.api.errors import APIError


class LaneObserver(Protocol):
    """What a lane reports (the Router's Ray metrics implement it)."""

    def lane_depth(self, lane: str, queued: int, in_flight: int) -> None: ...
    def lane_event(self, lane: str, event: str) -> None: ...  # admitted | rejected | timed_out


class NoObserver:
    def lane_depth(self, lane: str, queued: int, in_flight: int) -> None:
        pass

    def lane_event(self, lane: str, event: str) -> None:
        pass


class Slot:
    """One admitted request's claim on its lane; `release` is idempotent."""

    def __init__(self, lane: Lane, queued_s: float):
        self.lane = lane
        self.queued_s = queued_s
        self._held = True

    @property
    def name(self) -> str:
        return self.lane.name

    @property
    def priority(self) -> int:
        return self.lane.limits.priority

    def release(self) -> None:
        if self._held:
            self._held = False
            self.lane.release()


class Lane:
    def __init__(self, name: str, limits: LaneLimits, rejection: Rejection,
                 observer: LaneObserver):
        self.name = name
        self.limits = limits
        self.rejection = rejection
        self.observer = observer
        self.in_flight = 0
        self.admitted = 0  # since start
        self.waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self.waiters if not w.done())

    @property
    def full(self) -> bool:
        """A request arriving now would be refused."""
        return self.limits.refuses(self.in_flight, self.queued)

    async def admit(self) -> Slot:
        began = time.monotonic()
        if self.in_flight < self.limits.max_in_flight and not self.queued:
            self.in_flight += 1
        else:
            await self.wait_in_queue()
        self.admitted += 1
        self.observer.lane_event(self.name, "admitted")
        self.report()
        return Slot(self, time.monotonic() - began)

    async def wait_in_queue(self) -> None:
        if self.queued >= self.limits.max_queue:
            self.observer.lane_event(self.name, "rejected")
            raise self.rejection.queue_full(self.name, self.limits)
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self.report()
        try:
            async with asyncio.timeout(self.limits.queue_timeout_s):
                await waiter
        except TimeoutError:
            self.leave_queue(waiter)
            self.observer.lane_event(self.name, "timed_out")
            raise self.rejection.queue_timeout(self.name, self.limits) from None
        except asyncio.CancelledError:  # the client went away while queued
            self.leave_queue(waiter)
            raise

    def adopt(self) -> Slot:
        """Count a slot granted before this lane existed (an admission replica restarted and a
        Router still holds it); may go over `max_in_flight` until such slots are released."""
        self.in_flight += 1
        self.report()
        return Slot(self, 0.0)

    def leave_queue(self, waiter: asyncio.Future) -> None:
        """Called when a queued request gives up; a slot handed to it meanwhile is passed on."""
        if waiter.done() and not waiter.cancelled():
            self.release()
        else:
            waiter.cancel()
        self.waiters = deque(w for w in self.waiters if w is not waiter)
        self.report()

    def release(self) -> None:
        """Hand the slot to the oldest live waiter, or free it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.report()
                return
        self.in_flight -= 1
        self.report()

    def report(self) -> None:
        self.observer.lane_depth(self.name, self.queued, self.in_flight)


class Rejection:
    """The errors of lane admission, with the configured status and Retry-After."""

    def __init__(self, status: int, retry_after_s: int):
        self.status = status
        self.headers = {"Retry-After": str(retry_after_s)}

    def queue_full(self, lane: str, limits: LaneLimits) -> APIError:
        return APIError(self.status, f"the {lane} lane is full ({limits.max_in_flight} in flight, "
                        f"{limits.max_queue} queued); retry after {self.headers['Retry-After']} s",
                        type="rate_limit_exceeded" if self.status == 429 else "service_unavailable",
                        code="lane_full", headers=self.headers)

    def queue_timeout(self, lane: str, limits: LaneLimits) -> APIError:
        return APIError(503, f"waited {limits.queue_timeout_s:g} s in the {lane} lane's queue "
                        "without a slot; the server is overloaded, retry later",
                        type="service_unavailable", code="lane_timeout", headers=self.headers)


class Lanes:
    """The Router's lanes, built from `router.lanes`."""

    def __init__(self, config: LanesConfig, observer: LaneObserver | None = None):
        self.config = config
        self.rejection = Rejection(config.reject_status, config.retry_after_s)
        observer = observer or NoObserver()
        self.lanes = {name: Lane(name, limits, self.rejection, observer)
                      for name, limits in config.active().items()}
        for lane in self.lanes.values():
            lane.report()

    def classify(self, num_prompt_tokens: int, hint: str | None) -> str:
        """The lane for a prompt of this many tokens (image tokens included) and a hint header."""
        if not self.config.enabled:
            return "fifo"
        is_long = num_prompt_tokens >= self.config.long_context_threshold_tokens
        natural = "long_context" if is_long else "interactive"
        if hint is None or hint == natural:
            return natural
        return self.check_hint(hint, natural, num_prompt_tokens)

    def check_hint(self, hint: str, natural: str, num_prompt_tokens: int) -> str:
        header = self.config.hint_header
        if hint not in self.lanes:
            raise APIError(400, f"{header}: unknown lane {hint!r}; use 'interactive' or "
                           "'long_context'", param=header)
        if hint == "interactive":
            raise APIError(400, f"{header}: 'interactive' takes prompts under "
                           f"{self.config.long_context_threshold_tokens} tokens; this one has "
                           f"{num_prompt_tokens} (leave the header out to use 'long_context')",
                           param=header)
        return hint

    async def admit(self, lane: str) -> Slot:
        return await self.lanes[lane].admit()

    def refuse_early(self, hint: str | None, max_prompt_tokens: int | None,
                     is_full=None) -> None:
        """Before a request is tokenized or its images touched: the lane's refusal when every
        lane it may land in is full (by `is_full(name)`, default these lanes' own counts).
        `max_prompt_tokens` bounds its prompt (None: unknown, e.g. images); an invalid hint is
        left to `classify`."""
        lane = full_for(self.config, hint, max_prompt_tokens,
                        is_full or (lambda name: self.lanes[name].full))
        if lane is not None:
            self.lanes[lane].observer.lane_event(lane, "rejected")
            raise self.rejection.queue_full(lane, self.config.active()[lane])

    def counts(self) -> dict[str, dict[str, int]]:
        """Per lane: requests queued, in flight, and admitted since start."""
        return {name: {"queued": lane.queued, "in_flight": lane.in_flight,
                       "admitted": lane.admitted}
                for name, lane in self.lanes.items()}

    async def stats(self) -> dict[str, dict[str, int]]:
        return self.counts()


def full_for(config: LanesConfig, hint: str | None, max_prompt_tokens: int | None,
             is_full) -> str | None:
    """The lane to refuse a request with when every lane it may land in is full (`is_full(name)`),
    else None."""
    if not config.enabled:
        names = ["fifo"]
    elif hint == "long_context":
        names = ["long_context"]
    elif hint not in (None, "interactive"):
        return None
    elif max_prompt_tokens is not None and \
            max_prompt_tokens < config.long_context_threshold_tokens:
        names = ["interactive"]
    else:
        names = ["interactive", "long_context"]
    return names[0] if all(is_full(name) for name in names) else None
