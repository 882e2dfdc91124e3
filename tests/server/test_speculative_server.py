"""Speculative decoding in the running app: the session server drafts through the DraftService.

Greedy output with each drafter equals output without speculation (the same engine with the
`none` drafter: every step drafts nothing), on 20 text prompts and 2 image prompts (the slow
embedded DSpark drafter on every third text prompt and both images); seeded
sampled tokens follow the model's exact distribution with and without speculation; sessions are
released as requests finish. The engine-side spec counters prove drafts were proposed and
accepted, so the tests cannot pass by never speculating.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from moonserve.pipeline.bench.corpus import chat_prompts, copy_prompts
from moonserve.pipeline.config import load_app_config
from tests.conftest import LOCAL_CONFIG, MODEL

GREEDY_TOKENS = 32


def draft_handle(server):
    from ray import serve

    server.lm_handle()  # joins the server's Ray cluster
    return serve.get_deployment_handle("DraftService", app_name="moonserve")


CONFIGURED = load_app_config(LOCAL_CONFIG).draft.drafter  # what the session server drafts with


# The embedded DSpark drafter needs ~40 ms per block on this CPU, over the 25 ms configured:
# give it time, so its drafts reach the engine and get verified. It is untrained, so its drafts
# are rarely accepted, and adaptive depth (its threshold from the engine's step cost, which here
# includes those 40 ms) would leave it probing: k drafts every step instead.
DEADLINE_MS = {"dspark": 1000.0}
ADAPTIVE = {"dspark": False}
# At k drafts every step and ~40 ms a call, a conversation takes ~5 s with it: the DSpark arm runs
# every third text prompt and both image prompts (measured: 10 of its drafted tokens accepted
# there, 29 on all 22; its drafts are deterministic, so the count is too).
EVERY_NTH_TEXT = {"dspark": 3}


@contextmanager
def drafter(server, name: str):
    handle = draft_handle(server)
    handle.set_drafter.remote(name, ADAPTIVE.get(name)).result(timeout_s=60)
    handle.set_deadline.remote(DEADLINE_MS.get(name)).result(timeout_s=60)
    try:
        yield handle
    finally:
        handle.set_drafter.remote(CONFIGURED).result(timeout_s=60)
        handle.set_deadline.remote(None).result(timeout_s=60)


def spec_counters(server) -> tuple[int, int]:
    stats = server.lm_stats()
    return stats["num_draft_tokens"], stats["num_accepted_tokens"]


def image_messages() -> list[list[dict]]:
    from tests.server.test_multimodal import data_url, image_chat, png

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


@pytest.mark.parametrize("name", ["ngram", "suffix", "dspark"])
def test_greedy_output_with_each_drafter_equals_output_without(server, client, conversations,
                                                               without_speculation, name):
    texts_end = len(conversations) - len(image_messages())  # the images come last
    chosen = [*range(0, texts_end, EVERY_NTH_TEXT.get(name, 1)),
              *range(texts_end, len(conversations))]
    with drafter(server, name):
        drafted, accepted = spec_counters(server)
        texts = dict(zip(chosen, greedy_texts(client, [conversations[i] for i in chosen])))
        drafted, accepted = (a - b for a, b in zip(spec_counters(server), (drafted, accepted)))
    mismatched = [i for i in chosen if texts[i] != without_speculation[i]]
    assert not mismatched, [(i, texts[i], without_speculation[i]) for i in mismatched]
    assert accepted > 0, f"{name}: {drafted} draft tokens, none accepted: nothing was verified"


def test_agent_session_with_the_suffix_drafter_equals_it_without(server):
    """A BFCL multi-turn session as the speculation bench's `agentic` workload runs it (required
    tool calls held to their schemas, tool replies, turns building on earlier turns): the same
    transcript with the suffix drafter as without drafts, and its drafts were verified."""
    import asyncio

    from moonserve.pipeline.bench import agentic

    session = agentic.load_sessions(1)
    body = {"model": MODEL, "max_tokens": 256, "temperature": 0}
    url = f"{server.base_url}/v1/chat/completions"
    transcripts = {}
    for name in ("none", "suffix"):
        with drafter(server, name):
            before = spec_counters(server)
            results, transcripts[name], _ = asyncio.run(agentic.run_sessions(url, body, session, 1))
            drafted, accepted = (a - b for a, b in zip(spec_counters(server), before))
    assert transcripts["suffix"] == transcripts["none"]
    assert sum(bool(r.tool_calls) for r in results) >= len(session[0].turns)
    assert accepted > 0, f"suffix: {drafted} draft tokens, none accepted"


# Two copies of a line, then its start: after " lantern" (probability 0.45 at temperature 1) the
# n-gram drafter proposes " orbit velvet harbor copper", and the target agrees with " orbit" only
# 56% of the time, so a verifier that kept drafts it should reject would over-produce the copy.
SAMPLED_PROMPT = "river stone lantern orbit velvet harbor copper meadow\n" * 2 + "river stone"
SAMPLES = 200


def exact_pair_distribution(reference_model, prompt: str,
                            temperature: float) -> tuple[Counter, Counter]:
    """P(text of the first two sampled tokens), from the reference model's float64 softmax; pairs
    whose first token has probability < 0.005, or whose joint probability is < 1e-4, are left out
    (the tests pool them as the rest). Also P(text of the first token), whole: what conditional
    probabilities divide by (the kept pairs of a first token miss the tail of its second)."""
    import torch

    model, tokenizer = reference_model
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)
        firsts = (first >= 0.005).nonzero().flatten().tolist()
        second = model(torch.tensor([ids + [t] for t in firsts])).logits[:, -1].double()
        second = torch.softmax(second / temperature, -1)
    dist, first_texts = Counter(), Counter()
    for row, t0 in enumerate(firsts):
        first_texts[tokenizer.decode([t0])] += first[t0].item()
        joint = first[t0] * second[row]
        for t1 in (joint >= 1e-4).nonzero().flatten().tolist():
            dist[tokenizer.decode([t0, t1])] += joint[t1].item()
    return dist, first_texts


def sample_pairs(client, count: int) -> list[str]:
    # Unseeded: a seeded sampled request gets no drafts (see the test after this one's).
    def one(_) -> str:
        return client.completions.create(model=MODEL, prompt=SAMPLED_PROMPT, max_tokens=2,
                                         temperature=1.0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def fit_pvalue(samples: list[str], dist: Counter) -> float:
    """Chi-square goodness of fit to `dist`: texts expected 5+ times, and the pooled rest."""
    from scipy.stats import chisquare

    n, observed = len(samples), Counter(samples)
    texts = [t for t, p in dist.items() if p * n >= 5]
    expected = [dist[t] * n for t in texts]
    counts = [observed[t] for t in texts]
    return chisquare(counts + [n - sum(counts)], expected + [n - sum(expected)]).pvalue


def homogeneity_pvalue(a: list[str], b: list[str]) -> float:
    """Two-sample chi-square: texts seen 10+ times in both samples together, and the rest."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    texts = [t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= 10]
    rows = [[ca[t] for t in texts], [cb[t] for t in texts]]
    rows[0].append(len(a) - sum(rows[0]))
    rows[1].append(len(b) - sum(rows[1]))
    return chi2_contingency(rows).pvalue


FIRST, COPY = " lantern", " lantern orbit"


def copy_pvalue(samples: list[str], dist: Counter, first_texts: Counter) -> float:
    """Binomial test at the drafted position: of the samples that start with FIRST, the share
    that go on with the drafted " orbit" against its exact conditional probability, P(COPY) /
    P(FIRST) (0.557 here; dividing by the kept pairs' sum instead gave 0.633)."""
    from scipy.stats import binomtest

    share = dist[COPY] / sum(p for t, p in first_texts.items() if t.startswith(FIRST))
    started = sum(t.startswith(FIRST) for t in samples)
    return binomtest(samples.count(COPY), started, share).pvalue


def test_sampled_tokens_follow_the_exact_distribution_with_and_without(server, client,
                                                                       reference_model):
    exact, first_texts = exact_pair_distribution(reference_model, SAMPLED_PROMPT, 1.0)
    with drafter(server, "ngram"):
        before = spec_counters(server)
        with_spec = sample_pairs(client, SAMPLES)
        drafted, accepted = (a - b for a, b in zip(spec_counters(server), before))
    with drafter(server, "none"):
        without = sample_pairs(client, SAMPLES)
    print(f"\nsampled: {drafted} drafts, {accepted} accepted; {COPY!r}: "
          f"{with_spec.count(COPY)} with, {without.count(COPY)} without, "
          f"{exact[COPY] * SAMPLES:.1f} expected")
    # Drafts were verified, and some rejected: the copy is not always right at temperature 1.
    assert accepted > 0 and drafted > accepted, f"{drafted} drafts, {accepted} accepted"
    for name, samples in (("with speculation", with_spec), ("without", without)):
        p = fit_pvalue(samples, exact)
        assert p > 1e-3, f"{name}: not the model's distribution (p={p:.2g}): {Counter(samples)}"
        p = copy_pvalue(samples, exact, first_texts)
        assert p > 1e-3, f"{name}: {COPY!r} off its exact probability (p={p:.2g})"
    p = homogeneity_pvalue(with_spec, without)
    assert p > 1e-3, f"with and without speculation differ (p={p:.2g})"
    # Power: these samples tell the exact distribution from the one a verifier that accepted
    # every " orbit" draft would give (all of " lantern ..." moved to the copy). The count of the
    # copy alone does (binomial); the chi-square above pools that verifier's missing texts into
    # one bin and gave p = 0.0018 once on 57 copies in 200, against 93 expected.
    from scipy.stats import binomtest

    lossy_copy = sum(p for t, p in first_texts.items() if t.startswith(FIRST))
    p = binomtest(with_spec.count(COPY), len(with_spec), lossy_copy).pvalue
    assert p < 1e-3, f"the test cannot tell a lossy verifier's distribution apart (p={p:.2g})"


def test_seeded_sampled_requests_get_no_drafts_and_repeat(server, client):
    """Verification draws random numbers per draft token, and whether a draft beat its deadline
    varies from run to run; a seeded sampled request is therefore not drafted for, so its seed
    repeats the answer. Unseeded and greedy requests on the same copy prompt are drafted for."""
    kwargs = dict(model=MODEL, prompt=SAMPLED_PROMPT, max_tokens=24, temperature=1.0,
                  extra_body={"ignore_eos": True})
    with drafter(server, "ngram"):
        before = spec_counters(server)
        seeded = {client.completions.create(**kwargs, seed=11).choices[0].text for _ in range(3)}
        assert spec_counters(server)[0] == before[0], "a seeded sampled request was drafted for"
        assert len(seeded) == 1
        client.completions.create(**kwargs)
        client.completions.create(**{**kwargs, "temperature": 0}, seed=11)
        assert spec_counters(server)[0] > before[0]


def test_sessions_are_released_as_requests_finish(server, client):
    handle = draft_handle(server)
    before = handle.stats.remote().result(timeout_s=60)
    for prompt in copy_prompts(12, seed=5):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8)
    after = handle.stats.remote().result(timeout_s=60)
    assert after["num_opened"] - before["num_opened"] >= 12
    # Each request leaves the batch before the next starts: only the last may still be open.
    assert after["num_sessions"] <= 1
    assert after["num_released"] - before["num_released"] >= 11
