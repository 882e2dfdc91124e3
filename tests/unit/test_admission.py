"""Lanes for the whole application: the admission book, the Router side, and two Routers sharing it.

The book runs with a hand-moved clock for leases; the Routers are real (`Router`, real HTTP) over
the fake LanguageModel of test_router.py, with the LaneAdmission deployment class behind the same
fake handle.
"""

from __future__ import annotations

import asyncio

import pytest

from moonserve.deployments.admission import LaneAdmission
from moonserve.deployments.router import Router
from moonserve.pipeline.api import application_lanes
from moonserve.pipeline.api.application_lanes import (
    GRANT_GRACE_S,
    LEASE_S,
    AdmissionBook,
    SharedLanes,
)
from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.config import LaneLimits, LanesConfig, RouterConfig
from tests.unit.test_router import (  # noqa: F401 - fixtures
    FakeDeploymentHandle,
    assert_error,
    chat,
    lm,
    lm_handle,
    model_path,
    serving,
    wait_for,
)

pytestmark = pytest.mark.asyncio

ONE_SLOT = LanesConfig(interactive=LaneLimits(max_in_flight=1, max_queue=1, queue_timeout_s=30),
                       retry_after_s=3)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_flight(book: AdmissionBook, lane: str = "interactive") -> int:
    return book.lanes.lanes[lane].in_flight


async def wait_queued(book: AdmissionBook, count: int, lane: str = "interactive") -> None:
    await wait_for(lambda: book.lanes.lanes[lane].queued == count, f"{count} queued in the book")


async def test_limits_hold_across_holders_and_a_release_admits_the_queued():
    book = AdmissionBook(ONE_SLOT)
    assert await book.admit("router-a", "t1", "interactive") is None
    waiting = asyncio.create_task(book.admit("router-b", "t2", "interactive"))
    await wait_queued(book, 1)
    assert await book.admit("router-b", "t3", "interactive") == "lane_full"
    book.release("router-a", ["t1"])
    assert await waiting is None
    assert in_flight(book) == 1 and set(book.holders["router-b"].slots) == {"t2"}
    book.release("router-b", ["t2"])
    book.release("router-b", ["t2"])  # twice, or a ticket never granted: ignored
    book.release("router-c", ["t9"])
    assert in_flight(book) == 0


async def test_queue_timeout_and_cancel_leave_the_queue():
    config = LanesConfig(interactive=LaneLimits(max_in_flight=1, max_queue=2, queue_timeout_s=0.05))
    book = AdmissionBook(config)
    await book.admit("a", "t1", "interactive")
    assert await book.admit("b", "t2", "interactive") == "lane_timeout"
    gone = asyncio.create_task(book.admit("b", "t3", "interactive"))
    await wait_queued(book, 1)
    gone.cancel()  # what Serve does in the replica when the Router cancels the call
    await wait_queued(book, 0)
    book.release("a", ["t1"])
    assert in_flight(book) == 0 and "t3" not in book.holders["b"].slots


async def test_sync_releases_unlisted_slots_once_past_the_grace():
    clock = Clock()
    book = AdmissionBook(ONE_SLOT, clock=clock)
    await book.admit("a", "t1", "interactive")
    book.sync("a", {})  # the grant and the list may have crossed: kept
    assert in_flight(book) == 1
    clock.now += GRANT_GRACE_S + 0.1
    book.sync("a", {"t1": "interactive"})
    assert in_flight(book) == 1
    book.sync("a", {})  # its release never arrived
    assert in_flight(book) == 0 and book.reclaimed == 1


async def test_a_silent_holder_loses_its_slots_after_its_lease():
    clock = Clock()
    book = AdmissionBook(ONE_SLOT, clock=clock)
    await book.admit("dead", "t1", "interactive")
    clock.now += LEASE_S - 1
    book.sync("alive", {})
    assert in_flight(book) == 1
    clock.now += 2
    book.sync("alive", {})
    assert in_flight(book) == 0 and "dead" not in book.holders
    assert await book.admit("alive", "t2", "interactive") is None


async def test_a_restarted_book_adopts_what_routers_hold_on_their_first_list():
    book = AdmissionBook(ONE_SLOT)
    book.sync("a", {"t1": "interactive", "t2": "long_context"})
    assert in_flight(book) == 1 and in_flight(book, "long_context") == 1
    waiting = asyncio.create_task(book.admit("b", "t3", "interactive"))
    await wait_queued(book, 1)  # the adopted slot is the lane's only one
    waiting.cancel()
    # Later lists do not adopt (a ticket missing from the book then was released).
    book.sync("a", {"t1": "interactive", "t2": "long_context", "t4": "interactive"})
    assert "t4" not in book.holders["a"].slots


class Unreachable:
    """A LaneAdmission replica that cannot be reached."""

    async def admit(self, *args):
        raise ConnectionError("actor died")

    async def sync(self, *args):
        raise ConnectionError("actor died")

    async def release(self, *args):
        raise ConnectionError("actor died")


async def test_shared_lanes_refuse_with_the_lane_error_and_release_on_the_book():
    admission = LaneAdmission(ONE_SLOT)
    handle = FakeDeploymentHandle(admission)
    first, second = SharedLanes(ONE_SLOT, handle), SharedLanes(ONE_SLOT, handle)
    slot = await first.admit("interactive")
    assert slot.priority == 0 and slot.name == "interactive"
    queued_slot = asyncio.create_task(second.admit("interactive"))
    await wait_queued(admission.book, 1)
    with pytest.raises(APIError) as refused:
        await second.admit("interactive")
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "3"}
    assert "interactive lane is full" in refused.value.message
    slot.release()
    slot.release()
    other = await asyncio.wait_for(queued_slot, 5)
    assert (await second.stats())["interactive"] == {"queued": 0, "in_flight": 1, "admitted": 2}
    other.release()
    await wait_for(lambda: in_flight(admission.book) == 0, "the releases to reach the book")
    assert first.held == {} and second.held == {}
    for lanes in (first, second):
        lanes.heartbeat.cancel()


async def test_a_client_gone_while_queued_leaves_the_book_queue():
    admission = LaneAdmission(ONE_SLOT)
    lanes = SharedLanes(ONE_SLOT, FakeDeploymentHandle(admission))
    slot = await lanes.admit("interactive")
    waiting = asyncio.create_task(lanes.admit("interactive"))
    await wait_queued(admission.book, 1)
    waiting.cancel()
    await wait_queued(admission.book, 0)
    slot.release()
    await wait_for(lambda: in_flight(admission.book) == 0, "the release to reach the book")
    lanes.heartbeat.cancel()


async def test_unreachable_admission_falls_back_to_the_replicas_own_lanes(caplog, monkeypatch):
    monkeypatch.setattr(application_lanes, "HEARTBEAT_S", 0.01)
    lanes = SharedLanes(ONE_SLOT, FakeDeploymentHandle(Unreachable()))
    slot = await lanes.admit("interactive")
    assert lanes.local.lanes["interactive"].in_flight == 1
    await asyncio.sleep(0.05)  # heartbeats fail too: one warning in all
    assert sum("lane admission unavailable" in r.message for r in caplog.records) == 1
    slot.release()
    assert lanes.local.lanes["interactive"].in_flight == 0
    lanes.heartbeat.cancel()


async def test_the_heartbeat_lists_held_tickets(monkeypatch):
    monkeypatch.setattr(application_lanes, "HEARTBEAT_S", 0.01)
    admission = LaneAdmission(ONE_SLOT)
    lanes = SharedLanes(ONE_SLOT, FakeDeploymentHandle(admission))
    slot = await lanes.admit("interactive")
    await asyncio.sleep(0.05)
    record = admission.book.holders[lanes.holder]
    assert record.synced and set(record.slots) == {slot.ticket}
    slot.release()
    lanes.heartbeat.cancel()


@pytest.mark.parametrize("scope, second_status", [("application", 429), ("replica", 200)])
async def test_two_routers_share_the_lanes(model_path, lm, lm_handle, scope, second_status):
    """A request holds the only interactive slot through one Router; another Router refuses the
    next with the application's 429 (scope application) or admits it (scope replica)."""
    lanes = LanesConfig(interactive=LaneLimits(max_in_flight=1, max_queue=0), scope=scope)
    admission = FakeDeploymentHandle(LaneAdmission(lanes)) if scope == "application" else None
    routers = [Router(RouterConfig(lanes=lanes), lm_handle, model_path, admission=admission)
               for _ in range(2)]
    lm.hold_after = 0  # the first request holds its slot until the gate opens
    async with serving(routers[0]) as one, serving(routers[1]) as two:
        first = asyncio.create_task(one.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(lm.started.wait(), 10)
        second = asyncio.create_task(two.post("/v1/chat/completions", json=chat()))
        if second_status == 429:
            assert_error(await second, 429, None, "lane_full")
            assert (await routers[1].lane_stats())["interactive"]["in_flight"] == 1
        else:
            await wait_for(lambda: len(lm.requests) == 2, "the second request to reach the LM")
        lm.gate.set()
        assert (await first).status_code == 200
        assert (await second).status_code == second_status
    for router in routers:
        if isinstance(router.lanes, SharedLanes):
            router.lanes.heartbeat.cancel()


async def test_releases_of_one_loop_turn_go_in_one_call():
    admission = LaneAdmission(LanesConfig(interactive=LaneLimits(max_in_flight=3, max_queue=0)))
    handle = FakeDeploymentHandle(admission)
    lanes = SharedLanes(admission.book.lanes.config, handle)
    slots = [await lanes.admit("interactive") for _ in range(3)]
    for slot in slots:
        slot.release()
    await wait_for(lambda: in_flight(admission.book) == 0, "the releases to reach the book")
    releases = [c for c in handle.calls if c.method_name == "release"]
    assert len(releases) == 1
    lanes.heartbeat.cancel()


async def test_refuse_early_reads_the_applications_counts_from_the_last_heartbeat(monkeypatch):
    monkeypatch.setattr(application_lanes, "HEARTBEAT_S", 0.01)
    config = LanesConfig(interactive=LaneLimits(max_in_flight=1, max_queue=0))
    admission = LaneAdmission(config)
    holder, other = (SharedLanes(config, FakeDeploymentHandle(admission)) for _ in range(2))
    other.refuse_early(None, 10)  # no counts yet: nothing refused here
    slot = await holder.admit("interactive")
    other.start_heartbeat()
    await wait_for(lambda: other.counted and other.counted[1]["interactive"]["in_flight"] == 1,
                   "a heartbeat with the slot counted")
    other.heartbeat.cancel()
    # Those counts stay fresh for 2 x 5 s, not 20 ms: a loaded machine (the other pytest-xdist
    # worker's engines) may pause this process for longer than that between two lines.
    monkeypatch.setattr(application_lanes, "HEARTBEAT_S", 5.0)
    with pytest.raises(APIError) as refused:
        other.refuse_early(None, 10)
    assert refused.value.code == "lane_full"
    other.refuse_early(None, None)  # may be long: the long_context lane has room
    other.counted = (other.counted[0] - 11.0, other.counted[1])  # stale
    other.refuse_early(None, 10)
    slot.release()
    holder.heartbeat.cancel()
