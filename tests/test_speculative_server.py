"""Speculative decoding in the running app: the session server drafts through the DraftService.

Greedy output with each drafter equals output without speculation (the same engine with the
`none` drafter: every step drafts nothing), on 20 text prompts and 2 image prompts; sampled
tokens have the same distribution with and without speculation; sessions are released as requests
finish. The engine-side spec counters prove drafts were proposed and accepted, so the equality
tests cannot pass by never speculating.
"""

from __future__ import annotations

from collections import Counter
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


def sample_tokens(client, tokenizer, prompt: str, temperature: float, n: int,
                  num_tokens: int) -> list[tuple[int, ...]]:
    from concurrent.futures import ThreadPoolExecutor

    def one(seed: int) -> tuple[int, ...]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=num_tokens,
                                      temperature=temperature, seed=seed,
                                      extra_body={"ignore_eos": True})
        return tuple(tokenizer.encode(r.choices[0].text))

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def chi2_pvalue(a: list, b: list) -> float:
    """Two-sample chi-square test of homogeneity; categories with < 5 expected pooled."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    common = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= 10]
    rows = [[ca[k] for k in common], [cb[k] for k in common]]
    rest = [len(a) - sum(rows[0]), len(b) - sum(rows[1])]
    if min(rest) > 0:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    return chi2_contingency(rows).pvalue


def test_sampled_tokens_have_the_same_distribution_with_and_without(server, client,
                                                                    reference_model):
    _, tokenizer = reference_model
    # A repeated line: n-gram drafts from the first step on, and at temperature 1 the target
    # follows them only part of the time (at 1.5 it almost never does, and nothing is accepted),
    # so lossy verification would over-produce the copy.
    prompt = "river stone lantern orbit velvet harbor copper meadow\n" * 4 + "river stone"
    n, num_tokens, temperature = 160, 4, 1.0
    with drafter(server, "ngram"):
        before = spec_counters(server)
        with_spec = sample_tokens(client, tokenizer, prompt, temperature, n, num_tokens)
        drafted, accepted = (a - b for a, b in zip(spec_counters(server), before))
    with drafter(server, "none"):
        without = sample_tokens(client, tokenizer, prompt, temperature, n, num_tokens)
        colder = sample_tokens(client, tokenizer, prompt, 0.5, n, num_tokens)
    # Verification saw many drafts (a lossy verifier would have kept them all) and kept some.
    assert drafted > n and accepted > 0, f"{drafted} drafts, {accepted} accepted: too few to test"
    # Position 0 is sampled before any draft; the drafts are verified from position 1 on.
    for position in (1, 2):
        p = chi2_pvalue([s[:position + 1] for s in with_spec], [s[:position + 1] for s in without])
        assert p > 1e-3, f"prefix of {position + 1} tokens: distributions differ (p={p:.2g})"
    # Power check: the same test tells a modestly different distribution apart.
    p_power = chi2_pvalue([s[:3] for s in colder], [s[:3] for s in without])
    print(f"\nsampled: {drafted} drafts, {accepted} accepted; power check p={p_power:.2g}")
    assert p_power < 1e-3, f"the test cannot tell temperature 0.5 from 1.0 (p={p_power:.2g})"


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
