"""Lanes that hold for the whole application, whatever the number of Router replicas.

With `router.lanes.scope: application` and more than one Router replica, one `LaneAdmission`
replica (`deployments/admission.py`) keeps the lanes (`AdmissionBook`) and every Router replica
admits through it (`SharedLanes`): each lane's `max_in_flight` and `max_queue` are then the
application's, and a 429/503 means the whole application is full, not the replica a request
happened to reach. A request costs its Router one call to admit (queued there while its lane is
full); releases are not awaited, and those of one event-loop turn go in one call. Before a request
is tokenized, `refuse_early` refuses it on the application's counts as of the last heartbeat
(at most two heartbeats old) when every lane it may land in was full.

Nothing admitted is lost when a part fails:
- Each Router replica sends the tickets it holds every `HEARTBEAT_S`. The book releases a slot its
  holder no longer lists (a release call that never arrived, or a grant whose caller had gone),
  and every slot of a holder silent for `LEASE_S` (a Router replica that died).
- A restarted admission replica starts empty and adopts the slots each Router lists in its first
  heartbeat, so the counts are right again within a second.
- A Router that cannot reach the admission replica admits through its own lanes (the same limits,
  per replica) until it can, with a warning.

Example (the book without Serve):
    >>> book = AdmissionBook(LanesConfig())
    >>> await book.admit("router-a", "ticket-1", "interactive")    # None: admitted
    >>> book.release("router-a", ["ticket-1"])
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from moonserve.pipeline.api.background import in_background
from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.api.lanes import LaneObserver, Lanes, Slot
from moonserve.pipeline.config import LanesConfig

logger = logging.getLogger("moonserve.admission")

# How often a Router replica lists the tickets it holds.
HEARTBEAT_S = 1.0
# A holder silent this long has died: its slots are released.
LEASE_S = 10.0
# A slot granted this recently may be missing from its holder's list (the grant and the list
# crossed on the way): it is not released for that.
GRANT_GRACE_S = 5.0


@dataclass
class Holder:
    """One Router replica's slots in the book."""

    last_seen: float
    slots: dict[str, tuple[Slot, float]] = field(default_factory=dict)  # ticket -> (slot, granted)
    synced: bool = False  # its list has been read once since this book started


class AdmissionBook:
    """The application's lanes, and which Router replica holds each admitted slot."""

    def __init__(self, config: LanesConfig, observer: LaneObserver | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.lanes = Lanes(config, observer)
        self.clock = clock
        self.holders: dict[str, Holder] = {}
        self.reclaimed = 0  # slots released for their holder (not listed, or its lease ran out)

    async def admit(self, holder: str, ticket: str, lane: str) -> str | None:
        """Wait for a slot in `lane` for `ticket`; None when admitted, else the refusal's code
        (`lane_full` | `lane_timeout`). Cancelling the call leaves the queue."""
        self.expire()
        self.holder(holder)
        try:
            slot = await self.lanes.admit(lane)
        except APIError as exc:
            return exc.code
        # Looked up again: the holder may have expired while the ticket was queued.
        self.holder(holder).slots[ticket] = (slot, self.clock())
        return None

    def release(self, holder: str, tickets: list[str]) -> None:
        """Free the slots of `tickets`; a ticket the book does not hold is ignored."""
        record = self.holders.get(holder)
        for ticket in tickets:
            if record is not None and (held := record.slots.pop(ticket, None)) is not None:
                held[0].release()

    def sync(self, holder: str, tickets: dict[str, str]) -> dict[str, dict[str, int]]:
        """`holder` holds exactly `tickets` (ticket -> lane): release what it no longer lists
        (granted long enough ago to be listed); on its first list, adopt what the book lacks.
        Returns the lanes' counts."""
        now = self.clock()
        record = self.holder(holder)
        for ticket, (slot, granted) in list(record.slots.items()):
            if ticket not in tickets and now - granted > GRANT_GRACE_S:
                del record.slots[ticket]
                slot.release()
                self.reclaimed += 1
        if not record.synced:
            record.synced = True
            for ticket, lane in tickets.items():
                if ticket not in record.slots and lane in self.lanes.lanes:
                    record.slots[ticket] = (self.lanes.lanes[lane].adopt(), now)
        self.expire()
        return self.lanes.counts()

    def expire(self) -> None:
        """Release every slot of holders silent for `LEASE_S`."""
        now = self.clock()
        for name, record in list(self.holders.items()):
            if now - record.last_seen > LEASE_S:
                del self.holders[name]
                for slot, _ in record.slots.values():
                    slot.release()
                    self.reclaimed += 1

    def holder(self, name: str) -> Holder:
        record = self.holders.get(name)
        if record is None:
            record = self.holders[name] = Holder(self.clock())
        else:
            record.last_seen = self.clock()
        return record

    async def stats(self) -> dict[str, dict[str, int]]:
        self.expire()
        return await self.lanes.stats()


class SharedSlot:
    """A slot held in the admission replica; `release` is idempotent and not awaited."""

    def __init__(self, lanes: SharedLanes, ticket: str, name: str, priority: int,
                 queued_s: float):
        self.lanes = lanes
        self.ticket = ticket
        self.name = name
        self.priority = priority
        self.queued_s = queued_s
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.lanes.release(self.ticket)


class SharedLanes:
    """A Router replica's side of application-wide lanes; the same methods as `Lanes`.

    `admission` is the LaneAdmission deployment's handle."""

    def __init__(self, config: LanesConfig, admission, observer: LaneObserver | None = None):
        self.config = config
        self.admission = admission
        self.local = Lanes(config, observer)  # used while the admission replica is unreachable
        self.holder = uuid.uuid4().hex
        self.held: dict[str, str] = {}  # ticket -> lane
        self.releasing: list[str] = []  # released this event-loop turn, sent at its end
        self.heartbeat: asyncio.Task | None = None
        self.reachable = True
        # (when, the application's lane counts) from the last heartbeat
        self.counted: tuple[float, dict] | None = None

    def classify(self, num_prompt_tokens: int, hint: str | None) -> str:
        return self.local.classify(num_prompt_tokens, hint)

    def refuse_early(self, hint: str | None, max_prompt_tokens: int | None) -> None:
        """`Lanes.refuse_early` on the application's counts from the last heartbeat (at most
        `2 * HEARTBEAT_S` old; older or none: nothing is refused here)."""
        if self.counted is None or time.monotonic() - self.counted[0] > 2 * HEARTBEAT_S:
            return
        counts, limits = self.counted[1], self.config.active()
        self.local.refuse_early(hint, max_prompt_tokens, lambda name: limits[name].refuses(
            counts[name]["in_flight"], counts[name]["queued"]))

    async def admit(self, lane: str) -> SharedSlot | Slot:
        self.start_heartbeat()
        ticket = uuid.uuid4().hex
        began = time.monotonic()
        call = self.admission.admit.remote(self.holder, ticket, lane)
        try:
            refusal = await call
        except asyncio.CancelledError:  # the client went away while queued
            call.cancel()
            in_background(self.send_release([ticket]))  # in case it was granted
            raise
        except Exception as exc:  # noqa: BLE001 - admission down: this replica's lanes instead
            self.unreachable(exc)
            return await self.local.admit(lane)
        self.reachable = True
        if refusal == "lane_full":
            raise self.local.rejection.queue_full(lane, self.config.active()[lane])
        if refusal == "lane_timeout":
            raise self.local.rejection.queue_timeout(lane, self.config.active()[lane])
        self.held[ticket] = lane
        return SharedSlot(self, ticket, lane, self.config.active()[lane].priority,
                          time.monotonic() - began)

    def release(self, ticket: str) -> None:
        del self.held[ticket]
        if not self.releasing:
            asyncio.get_running_loop().call_soon(self.send_releases)
        self.releasing.append(ticket)

    def send_releases(self) -> None:
        tickets, self.releasing = self.releasing, []
        in_background(self.send_release(tickets))

    async def send_release(self, tickets: list[str]) -> None:
        try:
            await self.admission.release.remote(self.holder, tickets)
        except Exception as exc:  # noqa: BLE001 - the book frees them when they go unlisted
            self.unreachable(exc)

    def unreachable(self, exc: Exception) -> None:
        if self.reachable:
            logger.warning("lane admission unavailable (%s: %s); admitting through this "
                           "replica's own lanes until it is back", type(exc).__name__, exc)
        self.reachable = False

    def start_heartbeat(self) -> None:
        if self.heartbeat is None:
            self.heartbeat = asyncio.get_running_loop().create_task(self.beat())

    async def beat(self) -> None:
        """List the held tickets every `HEARTBEAT_S`, for as long as this replica lives."""
        while True:
            try:
                counts = await self.admission.sync.remote(self.holder, dict(self.held))
                self.counted = (time.monotonic(), counts)
                self.reachable = True
            except Exception as exc:  # noqa: BLE001 - retried at the next beat
                self.unreachable(exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def stats(self) -> dict[str, dict[str, int]]:
        """The application's lane counts (this replica's own while admission is unreachable)."""
        try:
            return await self.admission.lane_stats.remote()
        except Exception:  # noqa: BLE001
            return await self.local.stats()
