"""Lanes on the running cluster: a Router with tiny lanes bound to the session's LanguageModel.

One request holds the only interactive slot while others queue, get rejected (429 +
Retry-After), time out (503), or disconnect; the holder's stream must come through whole. With
two Router replicas the same limits hold for the application (one LaneAdmission replica), and a
Router replica that dies holding a slot loses it after its lease.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conftest import MODEL


# The engine's steps paced at 60 ms, drafts off: one token a step, about SmolLM2's pace here.
STEP_S = 0.06
# Long enough (~15 s) to outlast the queue-timeout step with a wide margin.
HOLD_TOKENS = 240
TINY_LANES = {
    "long_context_threshold_tokens": 64,
    "interactive": {"max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 3, "priority": 0},
    "long_context": {"max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 60, "priority": 10},
    "fifo": {"max_in_flight": 1, "max_queue": 1},
}


@pytest.fixture(scope="module", autouse=True)
def paced(server):
    with server.paced(STEP_S), server.drafter("none"):
        yield


@pytest.fixture(scope="module")
def tiny(server):
    with server.router_app("tiny", lanes=TINY_LANES) as url:
        from ray import serve

        yield url, serve.get_deployment_handle("Router", app_name="tiny")


@pytest.fixture(scope="module")
def shared(server):
    """Two Router replicas with the tiny lanes held for the application."""
    with server.router_app("shared", lanes=TINY_LANES,
                           deployment={"num_replicas": 2, "max_ongoing_requests": 16}) as url:
        from ray import serve

        yield url, serve.get_deployment_handle("LaneAdmission", app_name="shared")


def chat(content="Count to fifty.", max_tokens=4, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **fields}


def lane_stats(handle) -> dict:
    return handle.lane_stats.remote().result(timeout_s=60)


async def wait_for(handle, predicate, timeout_s=20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(lane_stats, handle)
        if predicate(stats):
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"lanes never reached the state; last: {stats}")


async def hold_slot(http: httpx.AsyncClient, url: str, max_tokens: int = HOLD_TOKENS,
                    lane: str = "interactive") -> tuple[int, int]:
    """A long stream that holds a slot of `lane`; returns (status, completion tokens)."""
    body = chat(max_tokens=max_tokens, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    tokens = 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={"x-moonserve-lane": lane}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return r.status_code, tokens


async def test_full_queue_rejects_fast_timeouts_answer_and_disconnects_leave(tiny):
    url, handle = tiny
    async with httpx.AsyncClient(timeout=120) as http:
        holder = asyncio.create_task(hold_slot(http, url))
        await wait_for(handle, lambda s: s["interactive"]["in_flight"] == 1)

        # Queued, then the client goes away: it must leave the queue at once.
        gone = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat()))
        await wait_for(handle, lambda s: s["interactive"]["queued"] == 1)
        gone.cancel()
        await wait_for(handle, lambda s: s["interactive"]["queued"] == 0, timeout_s=5)

        # Queued past queue_timeout_s (3 s): 503 with Retry-After.
        waiting = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat()))
        await wait_for(handle, lambda s: s["interactive"]["queued"] == 1)
        began = time.monotonic()
        # The queue is full now: the next one is refused at once.
        full = await http.post(f"{url}/v1/chat/completions", json=chat())
        assert full.status_code == 429, full.text
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "lane_full"
        assert time.monotonic() - began < 2
        timed_out = await waiting
        assert timed_out.status_code == 503, timed_out.text
        assert timed_out.json()["error"]["code"] == "lane_timeout"
        assert "retry-after" in timed_out.headers

        # Meanwhile the admitted stream came through whole.
        assert await holder == (200, HOLD_TOKENS)
    stats = (await asyncio.to_thread(lane_stats, handle))["interactive"]
    assert (stats["queued"], stats["in_flight"]) == (0, 0)


def test_long_prompt_goes_to_long_context_and_hint_rules(tiny):
    url, handle = tiny
    before = lane_stats(handle)
    long_text = " ".join(["river stone lantern"] * 40)  # well over 64 tokens
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(long_text), timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(long_text), timeout=60,
                   headers={"x-moonserve-lane": "interactive"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-moonserve-lane"
    r = httpx.post(f"{url}/v1/chat/completions", json=chat("hi"), timeout=120,
                   headers={"x-moonserve-lane": "long_context"})
    assert r.status_code == 200, r.text
    after = lane_stats(handle)
    assert after["long_context"]["admitted"] - before["long_context"]["admitted"] == 2
    assert after["interactive"]["admitted"] == before["interactive"]["admitted"]
    assert all((s["queued"], s["in_flight"]) == (0, 0) for s in after.values())


async def reach_every_router_replica(http: httpx.AsyncClient, url: str, admission) -> None:
    """Send small requests until both Router replicas have admitted through the book."""
    for _ in range(20):
        await asyncio.gather(*(http.post(f"{url}/v1/chat/completions", json=chat(max_tokens=1))
                               for _ in range(4)))
        if (await admission.holders.remote())["holders"] == 2:
            return
    raise AssertionError("the proxy never sent requests to both Router replicas")


async def test_lanes_hold_for_the_application_across_router_replicas(shared):
    url, admission = shared
    async with httpx.AsyncClient(timeout=120) as http:
        await reach_every_router_replica(http, url, admission)
        before = (await admission.lane_stats.remote())["long_context"]["admitted"]
        # Six at once into a lane of 1 in flight + 1 queued: per Router replica that would admit
        # up to four; for the application, two.
        # Long enough (~10 s each) that all six arrive while the first still holds its slot.
        results = await asyncio.gather(*(hold_slot(http, url, 160, "long_context")
                                         for _ in range(6)))
    assert sorted(results) == [(200, 160), (200, 160)] + [(429, 0)] * 4
    # A Router sends its releases after the stream's last bytes: they may land just after.
    stats = await wait_for(admission, lambda s: s["long_context"]["in_flight"] == 0, timeout_s=5)
    assert stats["long_context"]["admitted"] - before == 2
    assert stats["long_context"]["queued"] == 0


async def test_a_dead_router_replicas_slot_is_freed_after_its_lease(shared):
    import ray

    url, admission = shared
    async with httpx.AsyncClient(timeout=120) as http:
        holder = asyncio.create_task(hold_slot(http, url, HOLD_TOKENS, "long_context"))
        await wait_for(admission, lambda s: s["long_context"]["in_flight"] == 1)
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].startswith("SERVE_REPLICA::shared#Router#"):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        # The book counts the slot until the dead holder's lease runs out, then frees it.
        assert (await admission.lane_stats.remote())["long_context"]["in_flight"] == 1
        await wait_for(admission, lambda s: s["long_context"]["in_flight"] == 0, timeout_s=40)
        assert (await admission.holders.remote())["reclaimed"] >= 1
        try:
            _, tokens = await holder
        except httpx.HTTPError:  # the connection dropped with its Router
            tokens = 0
        assert tokens < HOLD_TOKENS
        deadline = time.monotonic() + 120
        while True:  # the replacement Router replicas come up
            r = await http.post(f"{url}/v1/chat/completions", json=chat(),
                                headers={"x-moonserve-lane": "long_context"})
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert r.status_code == 200, r.text
