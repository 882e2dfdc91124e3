"""The `suffix` drafter: its tree's counts and drafts against a brute-force reading of the
same definitions, and the per-request state (prompt, recent responses, prefetch, truncation)."""

from __future__ import annotations

import doctest
import random

import pytest
from pydantic import ValidationError

from moonserve.pipeline.speculative import suffix
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.drafter import Drafter, DrafterState
from moonserve.pipeline.speculative.sessions import DraftSessions
from moonserve.pipeline.speculative.suffix import SuffixDrafter, SuffixSettings, SuffixTree


def occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i:i + n] == pattern for seq in seqs for i in range(len(seq) - n + 1))


def brute_speculate(seqs, max_depth, context, k, factor, min_prob) -> tuple[list[int], float]:
    """The drafting rule of the module docstring over an uncompressed count of substrings."""
    alphabet = sorted({t for seq in seqs for t in seq})
    context = list(context[-max_depth:])
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(1, len(context)):
        path = context[-m:]
        if occurrences(seqs, path) == 0:
            break
        room = min(k, int(m * factor + 1e-6))
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < room and len(path) < max_depth:
            counts = {t: occurrences(seqs, path + [t]) for t in alphabet}
            token = max(counts, key=lambda t: (counts[t], -t))
            if counts[token] == 0:
                break
            prob *= counts[token] / occurrences(seqs, path)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            path = path + [token]
        if score >= best[1]:
            best = (tokens, score)
    return best


def nodes(tree: SuffixTree):
    stack = [tree.root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


@pytest.mark.parametrize("max_depth", [2, 3, 5, 8])
@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_counts_and_drafts_equal_brute_force(max_depth, alphabet):
    rng = random.Random(max_depth * 100 + alphabet)
    for _ in range(6):
        tree = SuffixTree(max_depth)
        seqs = [[] for _ in range(rng.randint(1, 3))]
        for _ in range(rng.randint(1, 12)):  # the sequences grow interleaved, in bursts
            i = rng.randrange(len(seqs))
            burst = [rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
            seqs[i].extend(burst)
            tree.extend(i, burst)
        for n in range(1, max_depth + 1):
            for start in range(3 * alphabet):
                pattern = [rng.randrange(alphabet) for _ in range(n)]
                assert tree.count(pattern) == occurrences(seqs, pattern), (seqs, pattern)
        assert tree.root.count == sum(map(len, seqs))
        for node in nodes(tree):  # compressed: a node and its only continuation never tie
            assert all(child.count < node.count or node is tree.root
                       for child in node.children.values())
            assert sum(c.count for c in node.children.values()) <= node.count
        assert sum(1 for _ in nodes(tree)) <= 2 * sum(map(len, seqs)) + 1
        for _ in range(10):
            context = [rng.randrange(alphabet) for _ in range(rng.randint(0, max_depth + 3))]
            k, factor, min_prob = rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0]), \
                rng.choice([0.0, 0.1, 0.4])
            assert tree.speculate(context, k, factor, min_prob) == \
                brute_speculate(seqs, max_depth, context, k, factor, min_prob), (seqs, context)


def test_long_repeats_stay_compressed():
    """A text repeated verbatim (an agent re-reading a file) adds no node per token per depth."""
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(300)]
    tree = SuffixTree(max_depth=24)
    tree.extend(0, text)
    before = sum(1 for _ in nodes(tree))
    tree.extend(0, text)
    tree.extend(1, text)
    assert sum(1 for _ in nodes(tree)) < before + 100
    assert tree.count(text[50:74]) == 3
    assert tree.speculate(text[:40], 8, 1.0, 0.1)[0] == text[40:48]


def test_settings_are_validated_and_named():
    with pytest.raises(ValidationError, match="max_depth"):
        SuffixSettings(max_depth=1)
    with pytest.raises(ValidationError, match="min_token_prob"):
        SuffixSettings(min_token_prob=1.5)
    with pytest.raises(ValidationError, match="unknown"):
        SuffixSettings(unknown=1)


def test_state_drafts_from_its_prompt_on_its_first_proposal():
    drafter = SuffixDrafter()
    assert isinstance(drafter, Drafter)
    state = drafter.new_state("r")
    assert isinstance(state, DrafterState)
    state.append([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert state.propose(3) == [7, 8]  # two tokens matched: at most two drafts (factor 1)
    state.append([7, 8])
    state.append([9])
    assert state.propose(3) == [1, 2, 5]
    assert state.propose(0) == []


def test_responses_of_earlier_requests_are_drafted_from():
    drafter = SuffixDrafter(SuffixSettings(max_depth=16))
    tool_call = [40, 41, 42, 43, 44, 45, 46, 47]
    first = drafter.new_state("a")
    first.append([1, 2, 3])
    for token in tool_call:
        first.append([token])
    second = drafter.new_state("b")
    second.append([9, 8, 7, 40, 41, 42])  # its prompt has never seen the call
    assert second.propose(4) == [43, 44, 45]  # three matched tokens: at most three drafts
    second.append([43, 44, 45])
    assert second.propose(4) == [46, 47]


def test_without_a_response_cache_each_request_drafts_alone():
    drafter = SuffixDrafter(SuffixSettings(max_cached_requests=0))
    first = drafter.new_state("a")
    first.append([1])
    first.append([40, 41, 42, 43])
    second = drafter.new_state("b")
    second.append([40, 41])
    assert second.propose(4) == []
    assert drafter.response_trees() == [drafter.current] and not drafter.current.seqs


def test_drafts_past_assumed_tokens_and_truncation_rebuilds():
    drafter = SuffixDrafter()
    state = drafter.new_state("r")
    state.append([1, 2, 3, 4, 1, 2])
    state.append([3])
    local = state.local
    assert state.propose_after([4, 1], 3) == [2, 3]  # as the service's prefetch asks
    assert state.local is local and list(state.token_ids) == [1, 2, 3, 4, 1, 2, 3]
    state.append([9])
    state.truncate(8)
    assert state.local is local
    state.truncate(4)  # the request's tree is rebuilt
    fresh = drafter.new_state("fresh")
    fresh.append([1, 2, 3, 4])
    assert state.local is not local and state.local.seqs == fresh.local.seqs
    assert state.propose(4) == fresh.propose(4)
    with pytest.raises(ValueError, match="num_tokens"):
        state.truncate(-1)


def test_recent_responses_are_bounded_and_the_oldest_forgotten():
    drafter = SuffixDrafter(SuffixSettings(max_cached_requests=4))
    responses = [[100 + 10 * i + j for j in range(5)] for i in range(7)]
    running = drafter.new_state("long")  # its response spans the trees' turnover
    running.append([1])
    running.append([7, 7])
    for i, response in enumerate(responses):
        state = drafter.new_state(f"r{i}")
        state.append([2])
        state.append(response)
        running.append([i])
    held = [seq for tree in drafter.response_trees() for seq in tree.seqs.values()]
    assert len(held) <= 4
    assert responses[-1] in held
    assert responses[0] not in held
    probe = drafter.new_state("probe")
    probe.append([9, 160, 161])
    assert probe.propose(2) == [162, 163]
    probe = drafter.new_state("probe-old")
    probe.append([9, 100, 101])
    assert probe.propose(2) == []
    assert [7, 7, 0, 1, 2, 3, 4, 5, 6] in [seq for tree in drafter.response_trees()
                                             for seq in tree.seqs.values()]


def test_sessions_run_the_suffix_drafter_with_prefetch():
    sessions = DraftSessions(SuffixDrafter(), adaptive=AdaptivePolicy(enabled=False))
    assert sessions.draft("r", [5, 6, 7, 8, 9, 5, 6], position=0, num_speculative_tokens=2) \
        == [7, 8]
    assert sessions.prefetch("r")  # drafts 9, 5, 6 past 7, 8
    assert sessions.draft("r", [7, 8, 9], position=7, num_speculative_tokens=2) == [5, 6]
    assert sessions.stats.num_prefetch_hits == 1


def test_docstring_examples():
    assert doctest.testmod(suffix).failed == 0
