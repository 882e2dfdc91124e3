"""Speculative decoding in the running app: the session server drafts through the DraftService.

Greedy output with each drafter equals output without speculation (the same engine with the
`none` drafter: every step drafts nothing), on 20 text prompts and 2 image prompts; seeded sampled
requests get no drafts and repeat; sessions are released as requests finish. The engine-side spec
counters prove drafts were proposed and accepted, so the tests cannot pass by never speculating.
On the tiny model (its greedy choices win by wide margins: tests/unit/test_tiny_model.py), whose
repeated tokens the drafters often guess and whose prompts' n-grams they often guess wrong. The
sampled distribution and an agent session with real tool calls: tests/smollm2/test_speculative.py.
"""

from __future__ import annotations

import pytest

from moonserve.pipeline.bench.corpus import chat_prompts, copy_prompts
from tests.conftest import MODEL
from tests.payloads import COPY_PROMPT
from tests.payloads import data_url, image_chat, png

GREEDY_TOKENS = 32
# The embedded DSpark drafter drafts on the engine's step: give it time (its 25 ms deadline is
# set for the step of SmolLM2, not the tiny model's), and k drafts every step (it is untrained,
# so adaptive depth would leave it probing).
DSPARK = {"adaptive": False, "deadline_ms": 1000.0}


def image_messages() -> list[list[dict]]:
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
    with server.drafter("none"):
        before = server.spec_counters()
        texts = greedy_texts(client, conversations)
        assert server.spec_counters()[1] == before[1], "the none drafter must draft nothing"
    return texts


@pytest.mark.parametrize("name", ["ngram", "suffix", "dspark"])
def test_greedy_output_with_each_drafter_equals_output_without(server, client, conversations,
                                                               without_speculation, name):
    with server.drafter(name, **(DSPARK if name == "dspark" else {})):
        drafted, accepted = server.spec_counters()
        texts = greedy_texts(client, conversations)
        drafted, accepted = (a - b for a, b in zip(server.spec_counters(), (drafted, accepted)))
    mismatched = [i for i, text in enumerate(texts) if text != without_speculation[i]]
    assert not mismatched, [(i, texts[i], without_speculation[i]) for i in mismatched]
    assert accepted > 0, f"{name}: {drafted} draft tokens, none accepted: nothing was verified"


def test_seeded_sampled_requests_get_no_drafts_and_repeat(server, client):
    """Verification draws random numbers per draft token, and whether a draft beat its deadline
    varies from run to run; a seeded sampled request is therefore not drafted for, so its seed
    repeats the answer. Unseeded and greedy requests on the same copy prompt are drafted for."""
    kwargs = dict(model=MODEL, prompt=COPY_PROMPT, max_tokens=24, temperature=1.0,
                  extra_body={"ignore_eos": True})
    with server.drafter("ngram"):
        before = server.spec_counters()
        seeded = {client.completions.create(**kwargs, seed=11).choices[0].text for _ in range(3)}
        assert server.spec_counters()[0] == before[0], "a seeded sampled request was drafted for"
        assert len(seeded) == 1
        client.completions.create(**kwargs)
        client.completions.create(**{**kwargs, "temperature": 0}, seed=11)
        assert server.spec_counters()[0] > before[0]


def test_sessions_are_released_as_requests_finish(server, client):
    handle = server.draft_handle()
    before = handle.stats.remote().result(timeout_s=60)
    for prompt in copy_prompts(12, seed=5):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8)
    after = handle.stats.remote().result(timeout_s=60)
    assert after["num_opened"] - before["num_opened"] >= 12
    # Each request leaves the batch before the next starts: only the last may still be open.
    assert after["num_sessions"] <= 1
    assert after["num_released"] - before["num_released"] >= 11
