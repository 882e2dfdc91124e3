"""Per-client rate limits (`moonserve.pipeline.api.token_buckets`) on a clock the test moves."""

from __future__ import annotations

import pytest

from moonserve.pipeline.api import token_buckets
from moonserve.pipeline.api.auth import client_id
from moonserve.pipeline.api.token_buckets import ClientBuckets, rate_limited
from moonserve.pipeline.config import RateLimitsConfig, RouterConfig


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter(**limits) -> tuple[ClientBuckets, Clock]:
    clock = Clock()
    return ClientBuckets(RateLimitsConfig(**limits), clock), clock


def test_requests_per_second_allow_a_seconds_burst_then_refill():
    buckets, clock = limiter(requests_per_s=4)
    assert [buckets.acquire("a") for _ in range(4)] == [None] * 4
    refusal = buckets.acquire("a")
    assert refusal.limit == "requests_per_s" and refusal.retry_after_s == pytest.approx(0.25)
    clock.now += 0.25
    assert buckets.acquire("a") is None
    assert buckets.acquire("a") is not None
    assert buckets.acquire("b") is None  # another client has its own buckets


def test_under_one_request_per_second_holds_one_request():
    buckets, clock = limiter(requests_per_s=0.5)
    assert buckets.acquire("a") is None
    assert buckets.acquire("a").retry_after_s == pytest.approx(2.0)
    clock.now += 1.0
    assert buckets.acquire("a").retry_after_s == pytest.approx(1.0)  # a refusal takes nothing


def test_tokens_are_charged_when_requests_end_and_debt_is_waited_out():
    buckets, clock = limiter(tokens_per_min=600)  # 10 tokens per second
    assert buckets.acquire("a") is None
    buckets.charge("a", 500)
    assert buckets.acquire("a") is None  # 100 left: still in
    buckets.charge("a", 400)  # 300 in debt
    refusal = buckets.acquire("a")
    assert refusal.limit == "tokens_per_min" and refusal.retry_after_s == pytest.approx(30.0)
    clock.now += 29.0
    assert buckets.acquire("a") is not None
    clock.now += 1.01
    assert buckets.acquire("a") is None
    clock.now += 3600
    buckets.charge("a", 0)
    assert buckets.tokens["a"].level == 600  # refills to a minute's worth, no more


def test_both_limits_the_tokens_one_first():
    buckets, _ = limiter(requests_per_s=1, tokens_per_min=60)
    buckets.charge("a", 61)
    assert buckets.acquire("a").limit == "tokens_per_min"
    assert buckets.acquire("b") is None and buckets.acquire("b").limit == "requests_per_s"


def test_no_limits_keep_no_state():
    buckets, _ = limiter()
    assert all(buckets.acquire("a") is None for _ in range(100))
    buckets.charge("a", 10**9)
    assert buckets.acquire("a") is None and buckets.num_clients == 0
    assert not RouterConfig().rate_limits.enabled()


def test_full_buckets_are_forgotten_once_many_clients_are_held(monkeypatch):
    monkeypatch.setattr(token_buckets, "PRUNE_AT", 10)
    buckets, clock = limiter(requests_per_s=1)
    for i in range(9):
        buckets.acquire(f"client-{i}")
    clock.now += 5  # every bucket refilled
    buckets.acquire("busy")
    assert buckets.num_clients == 1  # only the one that just took a request


def test_the_refusal_names_the_limit_and_says_when_to_retry():
    config = RateLimitsConfig(requests_per_s=0.5, tokens_per_min=1000)
    error = rate_limited(config, "tokens_per_min", 12.2)
    assert error.status == 429 and error.headers == {"Retry-After": "13"}
    assert "1000 tokens per minute" in error.message and "router.rate_limits.tokens_per_min" in \
        error.message
    assert error.body()["error"]["type"] == "rate_limit_exceeded"
    assert rate_limited(config, "requests_per_s", 0.01).headers == {"Retry-After": "1"}
    assert "0.5 requests per second" in rate_limited(config, "requests_per_s", 1).message


def test_clients_are_keys_by_digest_or_addresses():
    a = client_id("Bearer sk-alpha", "10.0.0.1", keyed=True)
    assert a == client_id("bearer  sk-alpha ", "10.0.0.2", keyed=True)  # same key anywhere
    assert a != client_id("Bearer sk-beta", "10.0.0.1", keyed=True)
    assert "sk-alpha" not in a
    assert client_id("Bearer sk-alpha", "10.0.0.1", keyed=False) == "address:10.0.0.1"


@pytest.mark.parametrize("limits, field", [
    ({"requests_per_s": 0}, "requests_per_s"), ({"tokens_per_min": -5}, "tokens_per_min"),
    ({"requests_per_minute": 5}, "requests_per_minute"),
])
def test_bad_limits_are_refused_naming_the_field(limits, field):
    with pytest.raises(ValueError, match=f"rate_limits.{field}"):
        RouterConfig.model_validate({"rate_limits": limits})
