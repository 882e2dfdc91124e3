"""Client disconnect storm: hundreds of streams opened and dropped at random points leave nothing
behind (engine requests, lane slots, queue entries), and the server answers normally after."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from tests.conftest import MODEL


STREAMS = 240


async def open_and_drop(session, url: str, rng: random.Random, outcome: dict) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {rng.random()}"}],
            "max_tokens": 64, "ignore_eos": True, "stream": True}
    drop_after_chunks = rng.choice([0, 0, 1, 3, 10])
    status = "dropped_waiting"  # dropped before the answer came (queued, or before a token)
    try:
        async with asyncio.timeout(rng.uniform(0.05, 8.0)):
            async with session.post(url, json=body) as response:
                status = response.status
                seen = 0
                async for _ in response.content:
                    seen += 1
                    if seen > drop_after_chunks:
                        break
    except TimeoutError:
        pass
    outcome[status] = outcome.get(status, 0) + 1


async def storm(url: str) -> dict:
    rng = random.Random(11)
    outcome: dict = {}
    # No connector limit: all the streams are open at once (aiohttp's default is 100).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(open_and_drop(session, url, rng, outcome) for _ in range(STREAMS)))
    return outcome


def wait_drained(server, router, timeout_s=60.0) -> tuple[dict, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        lm, lanes = server.lm_stats(), router.lane_stats.remote().result(timeout_s=60)
        idle = lm["num_unfinished_requests"] == 0 and all(
            (s["queued"], s["in_flight"]) == (0, 0) for s in lanes.values())
        if idle or time.monotonic() > deadline:
            return lm, lanes
        time.sleep(0.5)


def test_disconnect_storm_leaks_no_engine_request_or_lane_slot(server, client):
    from ray import serve

    outcome = asyncio.run(storm(f"{server.base_url}/v1/chat/completions"))
    assert sum(outcome.values()) == STREAMS, outcome
    assert not set(outcome) - {200, 429, "dropped_waiting"}, outcome  # never a 5xx
    server.lm_handle()  # joins the server's Ray cluster
    lm, lanes = wait_drained(server, serve.get_deployment_handle("Router", app_name="moonserve"))
    assert lm["num_unfinished_requests"] == 0, lm
    assert all((s["queued"], s["in_flight"]) == (0, 0) for s in lanes.values()), lanes
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert r.choices[0].message.content
