"""Drains that cut nothing: a Router app redeployed from two replicas to one under load.

Streams run through both Router replicas and outlast Serve's default 20 s graceful shutdown; the
app is redeployed meanwhile (every replica is replaced, and one fewer runs). Every stream must end
whole (all its tokens, a finish reason, `[DONE]`), and requests sent during the redeploy are
answered by the replicas that take over. The drain bound is `AppConfig.drain_s()`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.conftest import MODEL

STREAMS = 4
# One token a step (drafts off) at 60 ms a step: 30 s, well past Serve's default 20 s.
STREAM_TOKENS = 500
STEP_S = 0.06
TWO = {"num_replicas": 2, "max_ongoing_requests": 256}
ONE = {"num_replicas": 1, "max_ongoing_requests": 256}


def chat(max_tokens: int, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0, **fields}


async def stream(http: httpx.AsyncClient, url: str, started: asyncio.Event) -> tuple:
    """(status, completion tokens, finish reason, whether [DONE] came)."""
    body = chat(STREAM_TOKENS, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    tokens, finish, done = 0, None, False
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                started.set()
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return r.status_code, tokens, finish, done


def test_redeploying_the_router_under_load_cuts_no_stream(server):
    with server.paced(STEP_S), server.drafter("none"), \
            server.router_app("drain", deployment=TWO) as url:
        results, during, drained_s = asyncio.run(redeploy_under_load(server, url))
    assert results == [(200, STREAM_TOKENS, "length", True)] * STREAMS
    assert [r.status_code for r in during] == [200] * 3, [r.text for r in during]
    # The streams outlived Serve's default graceful shutdown: the drain bound is what held them.
    assert drained_s > 20, drained_s


async def redeploy_under_load(server, url: str) -> tuple[list, list, float]:
    """Streams through both replicas, the app redeployed to one meanwhile, and requests sent
    during it: the streams' results, those requests' responses, and how long the streams ran on
    after the redeploy began."""
    async with httpx.AsyncClient(timeout=600) as http:
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream(http, url, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        redeployed = time.monotonic()
        await asyncio.to_thread(server.deploy_router, "drain", deployment=ONE)
        during = [await http.post(f"{url}/v1/chat/completions", json=chat(4)) for _ in range(3)]
        results = await asyncio.gather(*streams)
        return results, during, time.monotonic() - redeployed
