"""The OpenAI API of the running pipeline: real HTTP, real `openai` client, real vLLM engine (on
the tiny model; what needs SmolLM2's own text is in tests/smollm2/test_text.py)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx

from tests.conftest import MODEL


def test_stream_equals_non_stream_and_reports_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about rivers."}],
                  temperature=0, max_tokens=20)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))

    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_held(client):
    """`usage.prompt_tokens_details.cached_tokens`, OpenAI's field, from vLLM's count."""
    messages = [{"role": "user", "content": "Read this twice: " + "harbor lantern orbit " * 60}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           temperature=0, user="cache-probe")
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           temperature=0, user="cache-probe")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached < again.usage.prompt_tokens


def test_raw_sse_framing_ends_with_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-1])


def test_text_parts_are_joined_like_a_string(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    string = [{"role": "user", "content": "What is the capital\nof France?"}]
    as_parts, as_string = (client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                                          messages=m) for m in (parts, string))
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    tokens = [httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": m},
                         timeout=30).json()["tokens"] for m in (parts, string)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == as_parts.usage.prompt_tokens


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a name for a ship."}],
                  temperature=1.0, top_p=0.95, max_tokens=16)
    a = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    others = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content
              for s in (1, 2, 3, 4)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should not all give the same sample"


def test_max_tokens_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                       max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_penalties_change_greedy_output(client):
    kwargs = dict(model=MODEL, prompt="the the the the the the", temperature=0, max_tokens=12)
    plain = client.completions.create(**kwargs).choices[0].text
    penalized = client.completions.create(**kwargs, frequency_penalty=2.0,
                                          presence_penalty=2.0).choices[0].text
    assert plain != penalized


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_serve_runs_with_moonserves_serve_env(server):
    """The Serve controller and the replicas of the cluster `moonserve serve` started read
    SERVE_ENV (they inherit the driver's environment)."""
    from moonserve.pipeline.app.server import SERVE_ENV

    titles = ("ray::ServeController", "ray::ServeReplica:moonserve:Router")
    seen = {}
    for process in server.process.descendants():
        command = " ".join(process.cmdline())  # Ray retitles a worker with its current task
        for title in titles:
            if command.startswith(title):
                environ = process.environ()
                seen[title] = {k: environ.get(k) for k in SERVE_ENV}
    assert set(seen) == set(titles), seen
    assert all(env == SERVE_ENV for env in seen.values()), seen


def test_concurrent_streams_all_complete(server):
    async def one(session, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}."}],
                "max_tokens": 12, "temperature": 0, "stream": True}
        async with session.post(f"{server.base_url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            lines = [line async for line in r.content if line.strip()]
        return lines[-1].strip()

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(8)))

    assert asyncio.run(main()) == [b"data: [DONE]"] * 8


def test_client_disconnect_aborts_engine_request(server):
    # Paced at 50 ms a step, the 3000 tokens (up to 5 a step with drafts) would stream for 30 s
    # or more: only the abort ends them within the checks' 15 s.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    with server.paced(0.05):
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            assert server.lm_stats()["num_unfinished_requests"] == 1
        # Leaving the block closes the connection mid-stream.
        deadline = time.monotonic() + 15
        while (stats := server.lm_stats())["num_unfinished_requests"] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["num_unfinished_requests"] == 0
        deadline = time.monotonic() + 10
        while (stats := server.lm_stats())["num_running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["num_running"] == 0


def test_seeded_long_prompt_is_reproducible_and_keeps_the_engine_alive(client):
    # Longer than one engine step's token budget: its prefill is chunked and the sample of the
    # partial chunk discarded, which vLLM's CPU build fails on without pipeline/engine/vllm_plugin.py.
    prompt = "Count the words: " + " ".join(["river stone lantern"] * 40)
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0,
                                       seed=7).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
    assert r.choices[0].message.content
