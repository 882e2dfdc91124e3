"""Lanes on the running cluster: a Router with tiny lanes bound to the session's LanguageModel.

One request holds the only interactive slot while others queue, get rejected (429 +
Retry-After), time out (503), or disconnect; the holder's stream must come through whole.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conftest import MODEL


# Long enough (~15 s at ~15 tokens/s) to outlast the queue-timeout step with a wide margin.
HOLD_TOKENS = 240
TINY_LANES = {
    "long_context_threshold_tokens": 64,
    "interactive": {"max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 3, "priority": 0},
    "long_context": {"max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 60, "priority": 10},
    "fifo": {"max_in_flight": 1, "max_queue": 1},
}


@pytest.fixture(scope="module")
def tiny(server):
    with server.router_app("tiny", lanes=TINY_LANES) as url:
        from ray import serve

        yield url, serve.get_deployment_handle("Router", app_name="tiny")


def chat(content="Count to fifty.", max_tokens=4, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **fields}


def lane_stats(handle) -> dict:
    return handle.lane_stats.remote().result()


async def wait_for(handle, predicate, timeout_s=20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(lane_stats, handle)
        if predicate(stats):
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"lanes never reached the state; last: {stats}")


async def hold_slot(http: httpx.AsyncClient, url: str) -> tuple[int, int]:
    """A long stream that holds the interactive slot; returns (status, completion tokens)."""
    body = chat(max_tokens=HOLD_TOKENS, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    tokens = 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
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
