"""Speculative decoding with SmolLM2's real text: unseeded sampled tokens follow the model's
exact distribution (from transformers' softmax) with and without drafts, and a BFCL agent session
with real tool calls gives the same transcript with the suffix drafter as without. The greedy
equivalence of every drafter runs on the tiny model: tests/server/test_speculative_server.py."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import MODEL
from tests.payloads import COPY_PROMPT


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
        with server.drafter(name):
            before = server.spec_counters()
            results, transcripts[name], _ = asyncio.run(agentic.run_sessions(url, body, session, 1))
            drafted, accepted = (a - b for a, b in zip(server.spec_counters(), before))
    assert transcripts["suffix"] == transcripts["none"]
    assert sum(bool(r.tool_calls) for r in results) >= len(session[0].turns)
    assert accepted > 0, f"suffix: {drafted} draft tokens, none accepted"


# The sampled tests below continue COPY_PROMPT: after " lantern" (probability 0.45 at
# temperature 1) the n-gram drafter proposes " orbit velvet harbor copper", and SmolLM2 agrees
# with " orbit" only 56% of the time, so a verifier that kept drafts it should reject would
# over-produce the copy.
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


def sample_pairs(client, count: int, n: int = 16) -> list[str]:
    """`count` independent samples of two tokens, `n` a request (vLLM samples each choice as a
    request of its own, drafted for and verified alone; one request of 16 fills the engine's
    batch). Unseeded: a seeded sampled request gets no drafts (tests/server's
    test_seeded_sampled_requests_get_no_drafts_and_repeat)."""
    def some(k: int) -> list[str]:
        response = client.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=2,
                                             temperature=1.0, n=k,
                                             extra_body={"ignore_eos": True})
        return [choice.text for choice in response.choices]

    with ThreadPoolExecutor(2) as pool:
        batches = pool.map(some, [n] * (count // n) + ([count % n] if count % n else []))
        return [text for batch in batches for text in batch]


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
    exact, first_texts = exact_pair_distribution(reference_model, COPY_PROMPT, 1.0)
    with server.drafter("ngram"):
        before = server.spec_counters()
        with_spec = sample_pairs(client, SAMPLES)
        drafted, accepted = (a - b for a, b in zip(server.spec_counters(), before))
    with server.drafter("none"):
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
