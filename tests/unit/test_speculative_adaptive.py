"""Adaptive drafting depth (`moonserve.pipeline.speculative.adaptive`), on its own and through
`DraftSessions` with the real n-gram drafter against a simulated target that accepts exactly the
drafts that match its own next tokens, as vLLM's greedy verification does."""

from __future__ import annotations

import itertools
import random

import pytest

from moonserve.pipeline.speculative.adaptive import Acceptance, AdaptivePolicy, worth_drafting
from moonserve.pipeline.speculative.ngram import NgramDrafter
from moonserve.pipeline.speculative.sessions import DraftSessions

POLICY = AdaptivePolicy()
FIXED_K = AdaptivePolicy(enabled=False)


@pytest.mark.parametrize("p, expected", [
    (0.3, 1), (0.29, 0), (0.55, 2), (0.6, 2), (0.67, 3), (0.8, 5), (0.95, 8), (1.0, 8),
])
def test_worth_drafting_is_the_deepest_draft_still_likely_enough(p, expected):
    k = worth_drafting(p, 0.3, 8)
    assert k == expected
    assert k == 0 or p ** k >= 0.3 - 1e-12
    assert k == 8 or p ** (k + 1) < 0.3


@pytest.mark.parametrize("p", [0.0, 0.1, 0.9])
def test_a_step_that_verifies_every_slot_anyway_asks_for_full_depth(p):
    """min_acceptance 0 (model runner V2 verifies k drafts in every row): every draft is worth it."""
    assert worth_drafting(p, 0.0, 8) == 8


def test_no_evidence_drafts_one_and_a_copying_request_soon_drafts_the_most():
    acceptance = Acceptance()
    depths = []
    for _ in range(4):
        k = acceptance.num_drafts(8, POLICY)
        depths.append(k)
        acceptance.observe(drafted=k, accepted=k, policy=POLICY)
    assert depths[0] == 1 and depths == sorted(depths) and depths[-1] == 8


def test_rejections_pause_drafting_with_probes_spaced_ever_wider():
    acceptance = Acceptance(accepted=0.0, rejected=5.0)
    probes = []
    for step in range(200):
        k = acceptance.num_drafts(4, POLICY)
        assert k in (0, 1)
        if k:
            probes.append(step)
            acceptance.observe(drafted=1, accepted=0, policy=POLICY)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:4] == [9, 17, 33, 65]  # 8, 16, 32, 64 steps of nothing, then a probe
    acceptance = Acceptance(accepted=0.0, rejected=5.0, pause_left=0, next_pause=512)
    acceptance.num_drafts(4, AdaptivePolicy(max_pause_steps=100))
    assert acceptance.next_pause == 100


def test_accepted_probes_bring_drafting_back():
    acceptance = Acceptance(accepted=0.0, rejected=3.0)
    depths = []
    for _ in range(60):
        k = acceptance.num_drafts(4, POLICY)
        depths.append(k)
        acceptance.observe(drafted=k, accepted=k, policy=POLICY)
    assert depths[0] == 1 and depths[-1] == 4  # the first probe is accepted: no pause after it


def test_disabled_always_drafts_the_most():
    acceptance = Acceptance(accepted=0.0, rejected=50.0)
    assert [acceptance.num_drafts(4, FIXED_K) for _ in range(3)] == [4, 4, 4]


# What a draft token costs to verify, in decode steps: the break-even that the default
# `min_acceptance` (0.3) encodes. `work` = steps + this x drafted tokens.
VERIFY_COST = POLICY.min_acceptance


def run_target(truth: list[int], prompt_len: int, policy: AdaptivePolicy, k: int,
               tail_from: int | None = None) -> dict:
    """Decode `truth[prompt_len:]` with drafts from `DraftSessions`; the target keeps the drafts
    that match its next tokens, then adds one of its own (greedy verification). `tail_steps`:
    the steps taken once `tail_from` tokens are decoded."""
    sessions = DraftSessions(NgramDrafter(min_n=2, max_n=4), adaptive=policy)
    position, new = 0, truth[:prompt_len]
    n = prompt_len
    steps = drafted = accepted = tail_steps = 0
    while n < len(truth):
        tail_steps += tail_from is not None and n >= tail_from
        drafts = sessions.draft("r", new, position, k)
        position = n
        kept = 0
        while kept < len(drafts) and n + kept < len(truth) and drafts[kept] == truth[n + kept]:
            kept += 1
        new = truth[n:n + kept + 1]
        n += len(new)
        steps, drafted, accepted = steps + 1, drafted + len(drafts), accepted + kept
    assert n == len(truth)
    return {"steps": steps, "rejected": drafted - accepted, "tail_steps": tail_steps,
            "work": steps + VERIFY_COST * drafted}


def copy_text(rng: random.Random) -> list[int]:
    """A prompt of 200 random tokens, then an answer that copies long spans of it."""
    prompt = [rng.randrange(1000) for _ in range(200)]
    answer = []
    while len(answer) < 300:
        start = rng.randrange(150)
        answer += prompt[start:start + rng.randrange(20, 50)] + [rng.randrange(1000)]
    return prompt + answer


def noise_text(rng: random.Random) -> list[int]:
    """Tokens from 3 symbols: n-grams match all the time, their continuations are chance."""
    return [rng.randrange(3) for _ in range(500)]


def test_on_copied_text_adaptive_drafting_keeps_the_speedup():
    rng = random.Random(0)
    for _ in range(5):
        truth = copy_text(rng)
        fixed = run_target(truth, 200, FIXED_K, 4)
        adaptive = run_target(truth, 200, POLICY, 4)
        deep = run_target(truth, 200, POLICY, 8)
        assert fixed["steps"] < 0.4 * 300  # drafting works on this text
        assert adaptive["steps"] <= 1.1 * fixed["steps"]
        assert adaptive["work"] <= 1.02 * fixed["work"]
        assert deep["steps"] < adaptive["steps"]  # more drafts allowed: fewer steps


def test_on_noise_adaptive_drafting_wastes_a_fraction_of_the_drafts():
    rng = random.Random(1)
    for _ in range(5):
        truth = noise_text(rng)
        fixed = run_target(truth, 50, FIXED_K, 4)
        adaptive = run_target(truth, 50, POLICY, 4)
        assert fixed["rejected"] > 200  # fixed k: most steps verify 3 or so useless drafts
        assert adaptive["rejected"] < 0.4 * fixed["rejected"]
        assert adaptive["work"] < 0.8 * fixed["work"]


def test_text_that_turns_copyable_picks_drafting_up_again():
    rng = random.Random(2)
    noise = noise_text(rng)[:300]
    prompt = [1000 + rng.randrange(1000) for _ in range(100)]
    truth = prompt + noise + prompt * 2
    adaptive = run_target(truth, 100, POLICY, 4, tail_from=400)
    fixed = run_target(truth, 100, FIXED_K, 4, tail_from=400)
    assert fixed["tail_steps"] < 0.3 * 200  # the copied tail (200 tokens) drafts well
    # Paused through the noise, drafting picks up again within a few probes.
    assert adaptive["tail_steps"] <= fixed["tail_steps"] + 20
    assert adaptive["work"] < fixed["work"]
