"""The adaptive pause handed to the engine's proposer (`StepReply.quiet`): a paused request is left
out of the DraftService calls, and a step whose requests are all paused makes no call.

The real `ServiceProposer._propose` talks to a real `DraftCore` (n-gram drafter) in-process, with
each message encoded and decoded as on the wire; a simulated greedy target decodes a known text,
keeping the drafts that match it and adding one token of its own each step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import numpy as np

from moonserve.pipeline.engine.proposer import DraftBook, ProposerStats, ServiceProposer
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy, StepCost
from moonserve.pipeline.speculative.ngram import NgramDrafter
from moonserve.pipeline.speculative.service import DraftCore
from moonserve.pipeline.speculative.wire import StepReply, StepRequest

K = 4
MAX_LEN = 4096


class CoreClient:
    """`DraftClient.call` over a `DraftCore` in this process, through the wire encoding."""

    def __init__(self, core: DraftCore):
        self.core = core
        self.calls = 0
        self.rows = 0
        self.min_acceptance: list[float | None] = []  # as each request carried it

    def call(self, request: StepRequest) -> StepReply:
        self.calls += 1
        self.rows += len(request.rows)
        self.min_acceptance.append(request.min_acceptance)
        message = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
        reply, _ = self.core.step(message)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=StepReply)


def proposer(client: CoreClient, req_ids: list[str]) -> ServiceProposer:
    """A ServiceProposer as vLLM builds it, with the model runner's batch faked."""
    out = object.__new__(ServiceProposer)
    batch = SimpleNamespace(req_ids=req_ids, generators={}, random_reqs=set())
    out.k, out.max_model_len, out.tp_size = K, MAX_LEN, 1
    out.runner = SimpleNamespace(input_batch=batch)
    out.stats, out.client = ProposerStats(), client
    out.book, out.hidden_layers = DraftBook(K, MAX_LEN, out.stats), ()
    # A clock that stands still: no step-cost estimate unless a test moves it.
    out.cost, out.clock, out.last_step = StepCost(), lambda: 0.0, None
    return out


def decode(texts: dict[str, list[int]], prompt_len: int, policy: AdaptivePolicy,
           step_seconds=None) -> dict:
    """Decode every text at once (one batch row each) to its end; the service's sessions and
    the number of steps, calls, accepted drafts and draft tokens. With `step_seconds(n)`, the
    proposer's clock advances by that for a step verifying n tokens."""
    core = DraftCore({"ngram": lambda: NgramDrafter(min_n=2, max_n=4)}, "ngram",
                     prefetch=False, adaptive=policy)
    client = CoreClient(core)
    ids = list(texts)
    prop = proposer(client, ids)
    now = [0.0]
    if step_seconds is not None:
        prop.clock = lambda: now[0]
    drafted = 0
    tokens = np.zeros((len(ids), MAX_LEN), dtype=np.int64)
    lengths = [prompt_len] * len(ids)
    drafts = [[] for _ in ids]
    steps = accepted = 0
    tail_accepted = {r: 0 for r in ids}
    while any(n < len(texts[r]) for r, n in zip(ids, lengths)):
        sampled = []
        for i, r in enumerate(ids):
            truth, n = texts[r], lengths[i]
            if n >= len(truth):
                sampled.append([])
                continue
            kept = 0
            while kept < len(drafts[i]) and n + kept < len(truth) and \
                    drafts[i][kept] == truth[n + kept]:
                kept += 1
            new = truth[n:n + kept + 1]
            tokens[i, n:n + len(new)] = new
            lengths[i] += len(new)
            accepted += kept
            tail_accepted[r] += kept if n >= len(truth) - 150 else 0
            sampled.append(new)
        steps += 1
        if step_seconds is not None:
            now[0] += step_seconds(sum(1 + len(d) for d, t in zip(drafts, sampled) if t))
        drafts = prop._propose(sampled, np.array(lengths), tokens)
        drafted += sum(map(len, drafts))
    prop.runner.input_batch.req_ids = []  # every request left: released at the next step
    prop._propose([], np.array([]), tokens)
    return {"steps": steps, "calls": client.calls, "rows": client.rows, "accepted": accepted,
            "tail_accepted": tail_accepted, "core": core, "quiet": prop.stats.quiet,
            "drafted": drafted, "min_acceptance": client.min_acceptance, "wall_s": now[0],
            "cost": prop.cost}


def noise_then_copy(rng: random.Random) -> list[int]:
    """300 tokens of 3 symbols (n-grams match, continuations are chance), then 10 copies of a
    block of 50 distinct tokens (long enough for the widest pause the noise earns to end)."""
    block = list(range(100, 150))
    return [rng.randrange(3) for _ in range(300)] + block * 10


def test_paused_requests_are_left_out_and_all_paused_steps_make_no_call():
    rng = random.Random(0)
    texts = {f"r{i}": noise_then_copy(rng) for i in range(3)}
    fixed = decode(texts, 20, AdaptivePolicy(enabled=False))
    adaptive = decode(texts, 20, AdaptivePolicy())
    # Fixed k: one call per step, every request in it.
    assert fixed["calls"] == fixed["steps"] + 1  # + the final release
    # Adaptive: over the noise most rows and most calls are skipped.
    assert adaptive["rows"] < 0.5 * fixed["rows"]
    assert adaptive["calls"] < 0.6 * adaptive["steps"]
    assert adaptive["quiet"] > 0
    # ...and drafting comes back once the text turns copyable.
    assert all(n > 100 for n in adaptive["tail_accepted"].values()), adaptive["tail_accepted"]


def test_skipped_tokens_reach_the_service_with_the_next_row():
    """While a request is quiet its tokens wait; the next row it sends carries all of them, so
    the service's context is the whole text every time it drafts (checked at the end, before the
    release: the sessions hold exactly the decoded tokens)."""
    rng = random.Random(1)
    texts = {"a": noise_then_copy(rng)}
    core = DraftCore({"ngram": lambda: NgramDrafter(min_n=2, max_n=4)}, "ngram",
                     prefetch=False, adaptive=AdaptivePolicy())
    client = CoreClient(core)
    prop = proposer(client, ["a"])
    truth = texts["a"]
    tokens = np.zeros((1, MAX_LEN), dtype=np.int64)
    tokens[0, :len(truth)] = truth
    skipped_some = False
    for n in range(20, len(truth) + 1):
        calls = client.calls
        prop._propose([[truth[n - 1]]], np.array([n]), tokens)
        skipped_some |= client.calls == calls
        if client.calls > calls:  # the service got everything up to n
            assert core.sessions.num_tokens("a") == n
            assert core.sessions.state("a").token_ids == truth[:n]
    assert skipped_some


def test_a_step_without_drafts_samples_with_the_plain_sampler():
    """vLLM hands `_sample` its spec-decode metadata on every step once a speculator is
    configured; with no draft in the batch the proposer's wrapper passes None (vLLM's plain
    sampler), with any draft the metadata as it came (the rejection sampler)."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from moonserve.pipeline.engine.proposer import plain_sampling_without_drafts

    seen = []
    runner = SimpleNamespace(_sample=lambda logits, metadata: seen.append(metadata) or "sampled",
                             input_batch=SimpleNamespace(generators={}))
    plain_sampling_without_drafts(runner)
    none_drafted = SpecDecodeMetadata.make_dummy([[], [], []], torch.device("cpu"))
    some_drafted = SpecDecodeMetadata.make_dummy([[], [7, 8], []], torch.device("cpu"))
    logits = torch.zeros(3, 16)
    assert runner._sample(logits, none_drafted) == "sampled"
    assert runner._sample(logits, some_drafted) == "sampled"
    assert runner._sample(logits, None) == "sampled"
    assert seen == [None, some_drafted, None]
    # A seeded request keeps vLLM's path: its generator must be drawn from the same way each run.
    runner.input_batch.generators[1] = torch.Generator()
    runner._sample(logits, none_drafted)
    assert seen[-1] is none_drafted


def copyable(rng: random.Random, n: int = 400) -> list[int]:
    """Text a prompt-lookup drafter half predicts: blocks of 8 tokens, each a repeat of an
    earlier block or new noise, at random."""
    blocks = [[rng.randrange(1000) for _ in range(8)]]
    while sum(map(len, blocks)) < n:
        blocks.append(rng.choice(blocks) if rng.random() < 0.6 else
                      [rng.randrange(1000) for _ in range(8)])
    return [t for b in blocks for t in b]


def test_the_threshold_follows_the_engines_step_cost():
    """The proposer fits its step times (a + b * verified tokens) and sends b * tokens/s as the
    acceptance a draft needs: with verify tokens nearly free, at least the drafts the fixed 0.3
    allows; with each verify token as dear as a step, hardly any (probes)."""
    rng = random.Random(3)
    texts = {f"r{i}": copyable(rng) for i in range(4)}
    fixed = decode(texts, 20, AdaptivePolicy())
    cheap = decode(texts, 20, AdaptivePolicy(), step_seconds=lambda n: 0.050 + 0.0005 * n)
    dear = decode(texts, 20, AdaptivePolicy(), step_seconds=lambda n: 0.001 + 0.050 * n)
    assert fixed["min_acceptance"] == [None] * fixed["calls"]  # no clock: no estimate
    for run, b in ((cheap, 0.0005), (dear, 0.050)):
        assert abs(run["cost"].marginal_s() - b) < 1e-9  # the steps' own slope, fitted
        sent = [m for m in run["min_acceptance"] if m is not None]
        assert len(sent) >= 10
        produced = sum(len(t) for t in texts.values()) - 20 * len(texts)
        rate = produced / run["wall_s"]  # tokens/s over the whole decode
        assert 0.5 * b * rate < sent[-1] < 4 * b * rate, (sent[-1], b * rate)
    assert max(m for m in cheap["min_acceptance"] if m is not None) < 0.3
    assert dear["min_acceptance"][-1] > 0.9  # a step is mostly its verify tokens' cost
    assert cheap["drafted"] >= fixed["drafted"] and cheap["steps"] <= fixed["steps"]
    assert dear["drafted"] < 0.2 * fixed["drafted"]
    assert dear["steps"] > cheap["steps"]
