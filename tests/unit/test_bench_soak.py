"""`moonserve bench soak`'s judgement, on samples made here (the live run: tests/server/test_soak.py)."""

from __future__ import annotations

from collections import Counter

from moonserve.pipeline.bench.soak import KINDS, Mix, Options, Tally, judge


def samples(*rows: tuple[float, float, dict[str, float]]) -> list[dict]:
    return [{"t_s": t, "object_store_mb": store, "rss_mb": rss} for t, store, rss in rows]


def clean_tally() -> Tally:
    tally = Tally()
    for kind, outcome in [("chat", "ok"), ("bad", "rejected"), ("tool", "cut")]:
        tally.add(kind, outcome)
    return tally


def test_growth_counts_from_the_first_sample_after_the_warm_up():
    # Router grows 50% during the warm-up, then 5%; the LM 12% after it; a process that ended
    # before the last sample is not judged.
    rows = samples((0, 1.0, {"router 1": 100, "lm 2": 100, "gone 3": 10}),
                   (10, 1.0, {"router 1": 150, "lm 2": 100, "gone 3": 10}),
                   (20, 1.0, {"router 1": 157.5, "lm 2": 112}))
    result = judge(Options(warmup_s=10), clean_tally(), rows, 1.0, 1.0, 0.0)
    assert result["rss_warm_t_s"] == 10 and set(result["rss"]) == {"router 1", "lm 2"}
    assert result["rss"]["router 1"]["growth"] == 0.05
    assert result["max_rss_growth"] == 0.12
    assert result["goals"] == {"rss_growth_at_most_10pct": False,
                               "object_store_back_to_baseline": True, "nothing_lost": True,
                               "no_unexpected_5xx": True, "bad_requests_4xx": True}


def test_losses_a_bad_request_answered_200_and_the_store_are_each_a_goal():
    tally = clean_tally()
    tally.add("stream", "lost/cut stream", "last event: data: {}")
    tally.add("bad", "lost/HTTP 200")
    tally.unexpected_5xx = 1
    rows = samples((0, 1.0, {"a 1": 100}), (10, 3.0, {"a 1": 101}))
    result = judge(Options(warmup_s=0), tally, rows, baseline_mb=1.0, after_mb=1.5, settled_s=60)
    assert (result["sent"], result["lost"]) == (5, 2)
    assert [(x["kind"], x["outcome"], x["detail"]) for x in result["losses"]] == [
        ("stream", "lost/cut stream", "last event: data: {}"), ("bad", "lost/HTTP 200", "")]
    assert result["object_store"]["peak_mb"] == 3.0
    assert {k for k, met in result["goals"].items() if not met} == {
        "object_store_back_to_baseline", "nothing_lost", "no_unexpected_5xx", "bad_requests_4xx"}


def test_a_seed_draws_the_same_mix_of_every_kind():
    a, b = Mix("m", seed=3), Mix("m", seed=3)
    kinds = [a.kind() for _ in range(200)]
    assert kinds == [b.kind() for _ in range(200)]
    assert [a.body(k) for k in kinds[:50]] == [b.body(k) for k in kinds[:50]]
    assert set(kinds) == {"chat", "stream", "image", "tool", "cancel", "long", "bad"}


def test_every_kind_is_dealt_in_the_first_few_requests_and_each_deck_holds_the_mix():
    mix, deck = Mix("m", seed=5), sum(KINDS.values())
    kinds = [mix.kind() for _ in range(3 * deck)]
    assert set(kinds[:len(KINDS)]) == set(KINDS)
    for start in range(0, len(kinds), deck):
        assert Counter(kinds[start:start + deck]) == Counter(KINDS)
