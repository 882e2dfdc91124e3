"""Unit tests for moonserve.pipeline.speculative: the n-gram drafter (against vLLM's own matcher) and the
DraftService's per-request sessions. Pure Python: no Ray, no engine."""

from __future__ import annotations

import ast
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.drafter import Drafter, DrafterState
from moonserve.pipeline.speculative.ngram import NgramDrafter, NgramIndex, propose_ngram
from moonserve.pipeline.speculative.sessions import (
    ContextTooLongError,
    DraftSessions,
    MissingTokensError,
    SessionLimits,
    UnknownRequestError,
)

# The sessions' mechanics, with every proposal as long as asked.
FIXED_K = AdaptivePolicy(enabled=False)

VLLM_FUNCTION = "_find_longest_matched_ngram_and_propose_tokens"


def load_vllm_matcher():
    """vLLM's own matcher, taken from the installed source and run as plain Python.

    Importing `vllm.v1.spec_decode.ngram_proposer` pulls in all of `vllm.config` (~13 s on this
    machine), so the function's source is compiled on its own, without its numba decorator.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "v1" / "spec_decode" / "ngram_proposer.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    nodes = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == VLLM_FUNCTION
    ]
    if not nodes:
        return None
    nodes[0].decorator_list = []
    namespace = {"np": np}
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 -- vLLM's own installed source, on purpose
    return namespace[VLLM_FUNCTION]


VLLM_MATCHER = load_vllm_matcher()


def naive_propose(tokens, k, min_n, max_n, max_model_len=None):
    """O(n^2) spec: longest n with an earlier occurrence, earliest such occurrence."""
    num_tokens = len(tokens)
    if max_model_len is not None:
        k = min(k, max_model_len - num_tokens)
    if k <= 0 or num_tokens < min_n:
        return []
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        for start in range(num_tokens - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def vllm_propose(tokens, k, min_n, max_n, max_model_len=1 << 30):
    out = VLLM_MATCHER(
        np.asarray(tokens, dtype=np.int32), min_n, max_n, max_model_len, k
    )
    return out.tolist()


def random_sequences(seed, count):
    """Random and repetitive token sequences: small vocabularies force many matches."""
    rng = random.Random(seed)
    for _ in range(count):
        length = rng.randint(0, 60)
        vocab = rng.choice([2, 3, 5, 50])
        if rng.random() < 0.3:
            period = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            tokens = (period * 20)[:length]
        else:
            tokens = [rng.randrange(vocab) for _ in range(length)]
        yield tokens, rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 6)


def test_ngram_examples():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, min_n=2, max_n=3) == [3, 4, 1]
    assert propose_ngram([1, 2, 3], 3, min_n=1, max_n=3) == []
    assert propose_ngram([], 3, min_n=1, max_n=3) == []
    # the longest match wins over a more recent shorter one
    assert propose_ngram([7, 1, 2, 8, 5, 2, 9, 1, 2], 1, min_n=1, max_n=2) == [8]
    # the earliest occurrence of the longest match wins, as in vLLM
    assert propose_ngram([1, 2, 3, 1, 2, 4, 1, 2], 1, min_n=2, max_n=2) == [3]
    # capped by max_model_len
    assert propose_ngram([1, 2, 3, 1, 2], 3, min_n=1, max_n=3, max_model_len=6) == [3]


@pytest.mark.skipif(
    VLLM_MATCHER is None, reason="vllm's ngram_proposer.py is not installed"
)
def test_ngram_equals_vllm_on_random_and_repetitive_sequences():
    for tokens, min_n, extra, k in random_sequences(seed=0, count=1500):
        max_n = min_n + extra - 1
        expected = vllm_propose(tokens, k, min_n, max_n)
        assert propose_ngram(tokens, k, min_n, max_n) == expected, (
            tokens,
            min_n,
            max_n,
            k,
        )


@pytest.mark.skipif(
    VLLM_MATCHER is None, reason="vllm's ngram_proposer.py is not installed"
)
def test_ngram_equals_vllm_with_max_model_len():
    for tokens, min_n, extra, k in random_sequences(seed=1, count=300):
        max_model_len = len(tokens) + random.Random(len(tokens)).randint(-1, 3)
        expected = vllm_propose(tokens, k, min_n, min_n + extra - 1, max_model_len)
        got = propose_ngram(tokens, k, min_n, min_n + extra - 1, max_model_len)
        assert got == expected


def test_ngram_equals_naive_reference():
    for tokens, min_n, extra, k in random_sequences(seed=2, count=800):
        max_n = min_n + extra - 1
        assert propose_ngram(tokens, k, min_n, max_n) == naive_propose(
            tokens, k, min_n, max_n
        )


def test_incremental_index_with_truncation_equals_fresh_index():
    rng = random.Random(3)
    index = NgramIndex(min_n=1, max_n=4)
    for _ in range(600):
        if len(index) and rng.random() < 0.3:
            index.truncate(rng.randint(max(0, len(index) - 6), len(index)))
        else:
            index.append([rng.randrange(4) for _ in range(rng.randint(1, 4))])
        tokens = list(index.token_ids)
        assert index.propose(5) == naive_propose(tokens, 5, 1, 4)
        fresh = NgramIndex(1, 4)
        fresh.append(tokens)
        assert index._first_end == fresh._first_end


@pytest.mark.skipif(
    VLLM_MATCHER is None, reason="vllm's ngram_proposer.py is not installed"
)
def test_long_history_step_by_step_matches_vllm():
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 2000, size=20_000).tolist()
    index = NgramIndex(min_n=2, max_n=5)
    index.append(prompt)
    tokens = list(prompt)
    for step in range(5):
        copied = prompt[
            1000 * step : 1000 * step + 7
        ]  # the "model" copies from its prompt
        index.append(copied)
        tokens += copied
        assert index.propose(4) == vllm_propose(tokens, 4, 2, 5)


def test_drafter_protocol():
    drafter = NgramDrafter(min_n=1, max_n=3)
    assert isinstance(drafter, Drafter)
    assert isinstance(drafter.new_state("r"), DrafterState)
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_sessions(**limits):
    clock = FakeClock()
    sessions = DraftSessions(
        NgramDrafter(min_n=1, max_n=3), SessionLimits(**limits), clock, adaptive=FIXED_K
    )
    return sessions, clock


def test_incremental_extend():
    sessions, _ = make_sessions()
    assert sessions.extend("a", [1, 2, 3], position=0) == 3
    assert sessions.extend("a", [1], position=3) == 4
    assert sessions.propose("a", 2) == [2, 3]
    assert sessions.extend("a", [2], position=4) == 5
    assert sessions.propose("a", 5) == [3, 1, 2]
    assert sessions.num_total_tokens == 5


def test_resend_after_rejection_truncates():
    sessions, _ = make_sessions()
    sessions.extend("a", [1, 2, 3, 1, 2], position=0)
    # service assumed drafts [3, 1] accepted (prefetch); target accepted 3, then sampled 9
    sessions.extend("a", [3, 1], position=5)
    assert sessions.num_tokens("a") == 7
    assert sessions.extend("a", [3, 9], position=5) == 7
    assert list(sessions._sessions["a"].state.token_ids) == [1, 2, 3, 1, 2, 3, 9]
    assert (
        sessions.extend("a", [], position=4) == 4
    )  # target's context is shorter still
    assert sessions.propose("a", 3) == [2, 3, 1]
    assert sessions.num_total_tokens == 4
    assert sessions.stats.num_truncations == 2


def test_ahead_position_raises_and_resend_recovers():
    sessions, _ = make_sessions()
    sessions.extend("a", [1, 2, 3], position=0)
    with pytest.raises(MissingTokensError) as info:
        sessions.extend("a", [4], position=5)
    assert info.value.num_tokens_held == 3
    assert "resend" in str(info.value)
    with pytest.raises(MissingTokensError) as info:
        sessions.extend("new", [4], position=2)
    assert info.value.num_tokens_held == 0
    assert "new" not in sessions
    assert sessions.extend("a", [1, 2, 3, 7, 1], position=0) == 5
    assert sessions.propose("a", 2) == [2, 3]


def test_unknown_request_and_too_long_context():
    sessions, _ = make_sessions(max_total_tokens=10)
    with pytest.raises(UnknownRequestError, match="position 0"):
        sessions.propose("nope", 3)
    sessions.extend("a", [1] * 4, position=0)
    with pytest.raises(ContextTooLongError, match="max_total_tokens=10"):
        sessions.extend("a", [1] * 7, position=4)
    assert "a" not in sessions and sessions.num_total_tokens == 0


class CountingDrafter:
    """A drafter whose every proposal differs, to show caching makes answers idempotent."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    def new_state(self, request_id):
        drafter = self

        class State(NgramIndex):
            def propose(self, num_speculative_tokens):
                drafter.calls += 1
                return [drafter.calls] * num_speculative_tokens

        return State(1, 1)


def test_idempotent_per_request_and_position():
    drafter = CountingDrafter()
    sessions = DraftSessions(drafter, adaptive=FIXED_K)
    first = sessions.draft("a", [1, 2, 3], position=0, num_speculative_tokens=2)
    # a second tensor-parallel rank sends the same call
    assert sessions.draft("a", [1, 2, 3], position=0, num_speculative_tokens=2) == first
    assert sessions.draft("a", [3], position=2, num_speculative_tokens=2) == first
    assert drafter.calls == 1
    second = sessions.draft("a", [4], position=3, num_speculative_tokens=2)
    assert second != first and drafter.calls == 2
    assert sessions.draft("a", [9], position=3, num_speculative_tokens=2) != second
    assert sessions.stats.num_cached_proposals == 2


def test_release():
    sessions, _ = make_sessions()
    sessions.extend("a", [1, 2], position=0)
    sessions.extend("b", [3], position=0)
    assert sessions.release("a") is True
    assert sessions.release("a") is False
    assert sessions.num_sessions == 1 and sessions.num_total_tokens == 1


def test_idle_eviction():
    sessions, clock = make_sessions(idle_timeout_s=10)
    sessions.extend("a", [1], position=0)
    clock.now = 6
    sessions.extend("b", [2], position=0)
    clock.now = 12
    sessions.propose("b", 1)  # touching keeps b alive
    assert sessions.evict_idle() == ["a"]
    assert sessions.evict_idle(now=21) == []
    assert sessions.evict_idle(now=22.5) == ["b"]
    assert sessions.num_sessions == 0 and sessions.num_total_tokens == 0


def test_lru_eviction_by_sessions_and_tokens():
    sessions, _ = make_sessions(max_sessions=2, max_total_tokens=10)
    sessions.extend("a", [1] * 3, position=0)
    sessions.extend("b", [1] * 3, position=0)
    sessions.propose("a", 1)  # a is now more recent than b
    sessions.extend("c", [1] * 3, position=0)
    assert "b" not in sessions and "a" in sessions and "c" in sessions
    sessions.extend("c", [2] * 5, position=3)  # 3 + 8 > 10: evicts a
    assert "a" not in sessions and sessions.num_total_tokens == 8
    assert sessions.stats.num_evicted_lru == 2


def send(sessions, request_id, context, position):
    """The target side: send the tail after `position`; on missing tokens resend as told."""
    try:
        return sessions.draft(
            request_id, context[position:], position, num_speculative_tokens=4
        )
    except MissingTokensError as error:
        held = error.num_tokens_held
        return sessions.draft(
            request_id, context[held:], held, num_speculative_tokens=4
        )


def test_churn_stays_bounded_and_leaks_nothing():
    rng = random.Random(5)
    limits = {"max_sessions": 40, "max_total_tokens": 3_000, "idle_timeout_s": 30}
    sessions, clock = make_sessions(**limits)
    caller_contexts: dict[str, list[int]] = {}
    believed_held: dict[
        str, int
    ] = {}  # what the caller last sent; stale after evictions
    abandoned = evicted_idle_midway = 0
    for step in range(6_000):
        clock.now = step * 0.01 + 40 * (step // 1_000)  # a lull every 1000 calls
        request_id = f"req-{rng.randrange(1_000)}"
        context = caller_contexts.setdefault(request_id, [])
        roll = rng.random()
        if roll < 0.05:
            sessions.release(request_id)
            caller_contexts.pop(request_id)
            believed_held.pop(request_id, None)
            continue
        if roll < 0.07:
            abandoned += (
                1  # the caller forgets it; only idle or LRU eviction can reclaim it
            )
            caller_contexts.pop(request_id)
            believed_held.pop(request_id, None)
            continue
        if roll < 0.15 and context:
            del context[
                rng.randint(max(0, len(context) - 5), len(context)) :
            ]  # rejection
            believed_held[request_id] = min(
                believed_held.get(request_id, 0), len(context)
            )
        context += [rng.randrange(30) for _ in range(rng.choice([1, 2, 5, 40, 200]))]
        try:
            send(sessions, request_id, context, believed_held.get(request_id, 0))
        except ContextTooLongError:
            caller_contexts.pop(request_id)
            continue
        believed_held[request_id] = len(context)
        assert sessions.num_tokens(request_id) == len(context)
        assert sessions.num_sessions <= limits["max_sessions"]
        assert sessions.num_total_tokens <= limits["max_total_tokens"]
        assert list(sessions._sessions[request_id].state.token_ids) == context
        if step % 1_000 == 0:
            evicted_idle_midway += len(sessions.evict_idle())
        assert sessions.num_total_tokens == sum(
            len(s.state.token_ids) for s in sessions._sessions.values()
        )
    for request_id in list(caller_contexts):
        sessions.release(request_id)
    sessions.evict_idle(now=clock.now + 31)
    assert sessions.num_sessions == 0 and sessions.num_total_tokens == 0
    assert evicted_idle_midway > 0
    stats = sessions.stats
    assert abandoned > 0 and stats.num_evicted_lru > 0 and stats.num_truncations > 0
    assert (
        stats.num_opened
        == stats.num_released + stats.num_evicted_lru + stats.num_evicted_idle
    )


def test_docstring_examples():
    import doctest

    from moonserve.pipeline.speculative import drafter, ngram, sessions

    for module in (drafter, ngram, sessions):
        assert doctest.testmod(module).failed == 0, module.__name__
