"""Speculative decoding in the running app: the session server drafts through the DraftService.

Greedy output with each drafter equals output without speculation (the same engine with the
`none` drafter: every step drafts nothing), on 20 text prompts and 2 image prompts; sessions are
released as requests finish. The engine-side spec counters prove drafts were proposed and accepted, so the equality
tests cannot pass by never speculating.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pipeline.bench.corpus import chat_prompts, copy_prompts
from tests.conftest import MODEL

GREEDY_TOKENS = 32


def draft_handle(server):
    from ray import serve

    server.lm_handle()  # joins the server's Ray cluster
    return serve.get_deployment_handle("DraftService", app_name="moonserve")


# The embedded DSpark drafter needs ~40 ms per block on this CPU, over the 25 ms configured:
# give it time, so its drafts reach the engine and get verified.
DEADLINE_MS = {"dspark": 1000.0}


@contextmanager
def drafter(server, name: str):
    handle = draft_handle(server)
    handle.set_drafter.remote(name).result()
    handle.set_deadline.remote(DEADLINE_MS.get(name)).result()
    try:
        yield handle
    finally:
        handle.set_drafter.remote("ngram").result()
        handle.set_deadline.remote(None).result()


def spec_counters(server) -> tuple[int, int]:
    stats = server.lm_stats()
    return stats["num_draft_tokens"], stats["num_accepted_tokens"]


def image_messages() -> list[list[dict]]:
    from tests.test_multimodal import data_url, image_chat, png

    return [image_chat(data_url(png((70, 98), (200, 30, 30)))),
            image_chat(data_url(png((128, 64), (10, 90, 200))))]


def greedy_texts(client, conversations: list[list[dict]]) -> list[str]:
    # One at a time: the same batch shapes in every arm, so only speculation differs.
    return [client.chat.completions.create(model=MODEL, messages=m, max_tokens=GREEDY_TOKENS,
                                           temperature=0).choices[0].message.content
            for m in conversations]


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    texts = copy_prompts(14) + chat_prompts(6)
    return [[{"role": "user", "content": t}] for t in texts] + image_messages()


@pytest.fixture(scope="module")
def without_speculation(server, client, conversations) -> list[str]:
    with drafter(server, "none"):
        before = spec_counters(server)
        texts = greedy_texts(client, conversations)
        assert spec_counters(server)[1] == before[1], "the none drafter must draft nothing"
    return texts


@pytest.mark.parametrize("name", ["ngram", "dspark"])
def test_greedy_output_with_each_drafter_equals_output_without(server, client, conversations,
                                                               without_speculation, name):
    with drafter(server, name):
        drafted, accepted = spec_counters(server)
        texts = greedy_texts(client, conversations)
        drafted, accepted = (a - b for a, b in zip(spec_counters(server), (drafted, accepted)))
    mismatched = [i for i, (a, b) in enumerate(zip(texts, without_speculation)) if a != b]
    assert not mismatched, [(i, texts[i], without_speculation[i]) for i in mismatched]
    assert accepted > 0, f"{name}: {drafted} draft tokens, none accepted: nothing was verified"


def test_sessions_are_released_as_requests_finish(server, client):
    handle = draft_handle(server)
    before = handle.stats.remote().result()
    for prompt in copy_prompts(12, seed=5):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8)
    after = handle.stats.remote().result()
    assert after["num_opened"] - before["num_opened"] >= 12
    # Each request leaves the batch before the next starts: only the last may still be open.
    assert after["num_sessions"] <= 1
    assert after["num_released"] - before["num_released"] >= 11
