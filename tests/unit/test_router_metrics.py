"""The Router's per-token metrics without Ray: completion tokens reach the Ray counter in few calls
and none is lost; the inter-token histogram still gets one observation per token."""

from __future__ import annotations

from collections import defaultdict

from moonserve.pipeline import metrics
from moonserve.pipeline.metrics import TOKEN_COUNT_PERIOD_S, RequestTrace, RouterMetrics


class RecordedMetric:
    """Stands in for a Ray metric: keeps every call as (value, tags)."""

    def __init__(self):
        self.calls: list[tuple[float, dict]] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.calls.append((value, tags))

    observe = set = inc


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_metrics(monkeypatch) -> tuple[RouterMetrics, Clock]:
    monkeypatch.setattr(metrics, "make_metric", lambda name: RecordedMetric())
    clock = Clock()
    return RouterMetrics(clock=clock), clock


def totals(metric: RecordedMetric) -> dict[str, float]:
    out = defaultdict(float)
    for value, tags in metric.calls:
        out[tags["lane"]] += value
    return dict(out)


def test_tokens_reach_the_counter_in_few_calls_and_all_of_them_by_the_end(monkeypatch):
    m, clock = router_metrics(monkeypatch)
    counter = m.m["moonserve_completion_tokens"]
    chat = RequestTrace(m, "interactive", arrival=clock.now)
    long = RequestTrace(m, "long_context", arrival=clock.now)
    for step in range(300):  # 300 engine steps in 3 s: one token each for both requests
        clock.now += 0.01
        chat.delta(1)
        long.delta(2)
    assert 2 <= len(counter.calls) <= 2 * (3 / TOKEN_COUNT_PERIOD_S + 1)  # not one per token
    chat.finish(ok=True)
    long.finish(ok=True)
    assert totals(counter) == {"interactive": 300, "long_context": 600}
    itl = m.m["moonserve_inter_token_latency_seconds"]
    assert len(itl.calls) == 299 + 2 * 299  # every token after a request's first


def test_a_quiet_period_still_sends_what_was_counted_when_the_request_ends(monkeypatch):
    m, clock = router_metrics(monkeypatch)
    trace = RequestTrace(m, "interactive", arrival=clock.now)
    trace.delta(3)
    assert m.m["moonserve_completion_tokens"].calls == []  # within the period: held
    trace.finish(ok=False)
    assert totals(m.m["moonserve_completion_tokens"]) == {"interactive": 3}
