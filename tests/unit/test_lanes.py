"""Lane classification and admission (pure asyncio, no Ray): limits, FIFO hand-off, rejection,
timeouts, and queued requests that go away."""

from __future__ import annotations

import asyncio
import random

import pytest

from moonserve.pipeline.config import LaneLimits, LanesConfig
from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.api.lanes import Lanes


def lanes_config(**overrides) -> LanesConfig:
    base = dict(long_context_threshold_tokens=100,
                interactive=LaneLimits(max_in_flight=2, max_queue=2, queue_timeout_s=5, priority=0),
                long_context=LaneLimits(max_in_flight=1, max_queue=1, queue_timeout_s=5,
                                        priority=10))
    return LanesConfig(**{**base, **overrides})


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.depth: dict[str, tuple[int, int]] = {}

    def lane_depth(self, lane, queued, in_flight):
        self.depth[lane] = (queued, in_flight)

    def lane_event(self, lane, event):
        self.events.append((lane, event))


def test_classify_by_prompt_tokens_and_hint():
    lanes = Lanes(lanes_config())
    assert lanes.classify(99, None) == "interactive"
    assert lanes.classify(100, None) == "long_context"
    assert lanes.classify(5, "long_context") == "long_context"
    assert lanes.classify(5, "interactive") == "interactive"


@pytest.mark.parametrize("tokens, hint, needle", [
    (500, "interactive", "'interactive' takes prompts under 100 tokens; this one has 500"),
    (5, "batch", "unknown lane 'batch'"),
])
def test_hint_that_is_not_allowed_is_a_400_naming_the_header(tokens, hint, needle):
    with pytest.raises(APIError) as err:
        Lanes(lanes_config()).classify(tokens, hint)
    assert err.value.status == 400
    assert err.value.param == "x-moonserve-lane"
    assert needle in err.value.message


def test_lanes_off_is_one_fifo_lane_whatever_the_prompt():
    lanes = Lanes(lanes_config(enabled=False))
    assert list(lanes.lanes) == ["fifo"]
    assert lanes.classify(10_000, None) == lanes.classify(1, "long_context") == "fifo"


async def test_in_flight_limit_then_queue_then_rejection_with_retry_after():
    recorder = Recorder()
    lanes = Lanes(lanes_config(), observer=recorder)
    held = [await lanes.admit("interactive") for _ in range(2)]
    queued = [asyncio.create_task(lanes.admit("interactive")) for _ in range(2)]
    await asyncio.sleep(0)
    assert recorder.depth["interactive"] == (2, 2)
    with pytest.raises(APIError) as err:
        await lanes.admit("interactive")
    assert (err.value.status, err.value.code) == (429, "lane_full")
    assert err.value.headers["Retry-After"] == "1"
    # The other lane is untouched by interactive's queue.
    other = await lanes.admit("long_context")
    assert other.priority == 10
    held[0].release()
    first = await queued[0]
    assert not queued[1].done(), "the hand-off is one slot, to the oldest waiter"
    for slot in [held[1], first, other]:
        slot.release()
    (await queued[1]).release()
    assert recorder.depth["interactive"] == (0, 0)
    assert ("interactive", "rejected") in recorder.events


async def test_reject_status_503_when_configured():
    lanes = Lanes(lanes_config(reject_status=503, retry_after_s=7))
    await lanes.admit("long_context")
    waiting = asyncio.create_task(lanes.admit("long_context"))
    await asyncio.sleep(0)
    with pytest.raises(APIError) as err:
        await lanes.admit("long_context")
    assert (err.value.status, err.value.headers["Retry-After"]) == (503, "7")
    waiting.cancel()


async def test_queue_timeout_is_503_and_leaves_the_queue():
    limits = LaneLimits(max_in_flight=1, max_queue=4, queue_timeout_s=0.05)
    lanes = Lanes(lanes_config(interactive=limits))
    slot = await lanes.admit("interactive")
    with pytest.raises(APIError) as err:
        await lanes.admit("interactive")
    assert (err.value.status, err.value.code) == (503, "lane_timeout")
    assert "Retry-After" in err.value.headers
    assert lanes.lanes["interactive"].queued == 0
    slot.release()
    assert lanes.lanes["interactive"].in_flight == 0


async def test_cancelled_waiter_leaves_at_once_and_the_next_gets_the_slot():
    lanes = Lanes(lanes_config())
    held = [await lanes.admit("interactive") for _ in range(2)]
    gone = asyncio.create_task(lanes.admit("interactive"))
    stays = asyncio.create_task(lanes.admit("interactive"))
    await asyncio.sleep(0)
    gone.cancel()  # the client disconnected while queued
    await asyncio.sleep(0)
    lane = lanes.lanes["interactive"]
    assert lane.queued == 1
    held[0].release()
    slot = await asyncio.wait_for(stays, 1)
    assert lane.in_flight == 2
    for s in [held[1], slot]:
        s.release()
    assert (lane.in_flight, lane.queued) == (0, 0)


async def test_slot_handed_to_a_waiter_that_is_cancelled_in_the_same_tick_is_passed_on():
    lanes = Lanes(lanes_config())
    lane = lanes.lanes["interactive"]
    held = [await lanes.admit("interactive") for _ in range(2)]
    a = asyncio.create_task(lanes.admit("interactive"))
    b = asyncio.create_task(lanes.admit("interactive"))
    await asyncio.sleep(0)
    held[0].release()  # hands the slot to `a` ...
    a.cancel()         # ... which goes away before it runs
    slot_b = await asyncio.wait_for(b, 1)
    assert lane.in_flight == 2
    held[1].release()
    slot_b.release()
    slot_b.release()  # idempotent
    assert (lane.in_flight, lane.queued) == (0, 0)


async def test_churn_never_exceeds_limits_and_leaks_nothing():
    """600 requests with random hold times, cancels and timeouts against one small lane."""
    rng = random.Random(7)
    limits = LaneLimits(max_in_flight=3, max_queue=5, queue_timeout_s=0.02)
    lanes = Lanes(lanes_config(interactive=limits))
    lane = lanes.lanes["interactive"]
    holders = peak = 0  # counted by the test itself, not by the lane
    outcomes = {"done": 0, "rejected": 0, "cancelled": 0}

    async def one():
        nonlocal holders, peak
        try:
            slot = await lanes.admit("interactive")
        except APIError:
            outcomes["rejected"] += 1
            return
        holders += 1
        peak = max(peak, holders)
        try:
            await asyncio.sleep(rng.random() * 0.01)
        finally:
            holders -= 1
            slot.release()
        outcomes["done"] += 1

    tasks = []
    for _ in range(600):
        tasks.append(asyncio.create_task(one()))
        if rng.random() < 0.2:
            rng.choice(tasks).cancel()
        await asyncio.sleep(rng.random() * 0.0005)
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, asyncio.CancelledError):
            outcomes["cancelled"] += 1
    assert sum(outcomes.values()) == 600
    assert peak == 3 and outcomes["done"] > 0 and outcomes["rejected"] > 0
    assert (lane.in_flight, lane.queued, len(lane.waiters)) == (0, 0, 0)


async def fill(lanes: Lanes, lane: str) -> list[asyncio.Task]:
    """Every slot of `lane` taken and its queue full; returns the queued requests."""
    limits = lanes.config.active()[lane]
    for _ in range(limits.max_in_flight):
        await lanes.admit(lane)
    queued = [asyncio.get_running_loop().create_task(lanes.admit(lane))
              for _ in range(limits.max_queue)]
    await asyncio.sleep(0)
    assert lanes.lanes[lane].full
    return queued


@pytest.mark.parametrize("hint, max_tokens, refused", [
    (None, 50, "interactive"),         # surely short: interactive only, and it is full
    (None, 500, None),                 # may be long: long_context has room
    (None, None, None),                # unknown (images): the same
    ("long_context", 50, None),        # hinted to the lane with room
    ("express", 50, None),             # an invalid hint is classify's 400, later
])
async def test_refuse_early_only_when_every_possible_lane_is_full(hint, max_tokens, refused):
    recorder = Recorder()
    lanes = Lanes(lanes_config(), observer=recorder)
    queued = await fill(lanes, "interactive")
    if refused is None:
        lanes.refuse_early(hint, max_tokens)
    else:
        with pytest.raises(APIError) as err:
            lanes.refuse_early(hint, max_tokens)
        assert err.value.status == 429 and err.value.code == "lane_full"
        assert recorder.events[-1] == (refused, "rejected")
    for task in queued:
        task.cancel()


async def test_refuse_early_with_both_lanes_full_whatever_the_size():
    lanes = Lanes(lanes_config())
    queued = await fill(lanes, "interactive") + await fill(lanes, "long_context")
    for hint, max_tokens in ((None, None), (None, 500), ("long_context", 5)):
        with pytest.raises(APIError):
            lanes.refuse_early(hint, max_tokens)
    for task in queued:
        task.cancel()
