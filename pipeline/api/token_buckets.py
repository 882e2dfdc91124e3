"""Per-client rate limits (`router.rate_limits`): requests per second and tokens per minute.

A client is an API key (by digest: the key itself is never held here) or, with auth off, a client
address. Each client has two token buckets:

- requests: `requests_per_s` refill per second, holding at most max(1, requests_per_s), so a
  client may send one second's worth at once. Each request takes one.
- tokens: `tokens_per_min` refill per minute, holding at most `tokens_per_min`. A request is let in
  while the bucket is above zero; its prompt and completion tokens are charged when it ends (how
  many it will generate is not known before), so one large request may take the bucket below zero
  and the client then waits until it refills.

A refused request gets the seconds until the bucket that refused it lets one in (Retry-After).
The buckets (`ClientBuckets`) live in one `RateLimiter` deployment per application
(`deployments/rate_limiter.py`), so the limits hold for the application whatever the number of
Router replicas. Clients whose buckets are both full are forgotten (a full bucket is the same as
none), so memory follows active clients.

Example:
    >>> limiter = ClientBuckets(RateLimitsConfig(requests_per_s=2, tokens_per_min=600))
    >>> limiter.acquire("client-a"), limiter.acquire("client-a")
    (None, None)
    >>> refusal = limiter.acquire("client-a")       # the third request within a second
    >>> refusal.limit, round(refusal.retry_after_s, 2)
    ('requests_per_s', 0.5)
    >>> limiter.charge("client-b", 900)             # 300 tokens over: 30 s at 10 tokens/s
    >>> round(limiter.acquire("client-b").retry_after_s)
    30
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.config import RateLimitsConfig

# Forget full buckets once this many clients are held.
PRUNE_AT = 10_000


@dataclass
class TokenBucket:
    capacity: float
    rate_per_s: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / self.rate_per_s)

    @property
    def full(self) -> bool:
        return self.level >= self.capacity


@dataclass(frozen=True)
class Refusal:
    limit: str  # requests_per_s | tokens_per_min
    retry_after_s: float


class ClientBuckets:
    """Every client's request and token buckets (the RateLimiter deployment holds one)."""

    def __init__(self, config: RateLimitsConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.requests: dict[str, TokenBucket] = {}
        self.tokens: dict[str, TokenBucket] = {}

    def acquire(self, client: str) -> Refusal | None:
        """Take one request for `client`; None when it may go ahead."""
        now = self.clock()
        tokens = self._bucket(self.tokens, client, now, self.config.tokens_per_min, 60.0)
        if tokens is not None and tokens.level <= 0:
            # A fraction of a token over zero lets the next request in.
            return Refusal("tokens_per_min", tokens.seconds_until(1e-9))
        requests = self._bucket(self.requests, client, now, self.config.requests_per_s, 1.0)
        if requests is not None:
            if requests.level < 1:
                return Refusal("requests_per_s", requests.seconds_until(1.0))
            requests.level -= 1
        self._prune()
        return None

    def charge(self, client: str, num_tokens: int) -> None:
        """A request of `client` ended having used `num_tokens` (prompt and completion)."""
        bucket = self._bucket(self.tokens, client, self.clock(), self.config.tokens_per_min, 60.0)
        if bucket is not None:
            bucket.level -= num_tokens

    @property
    def num_clients(self) -> int:
        return len(self.requests.keys() | self.tokens.keys())

    def _bucket(self, buckets: dict[str, TokenBucket], client: str, now: float,
                per_period: float | None, period_s: float) -> TokenBucket | None:
        if per_period is None:
            return None
        bucket = buckets.get(client)
        if bucket is None:
            capacity = max(1.0, float(per_period))
            bucket = buckets[client] = TokenBucket(capacity, per_period / period_s, capacity, now)
        bucket.refill(now)
        return bucket

    def _prune(self) -> None:
        for buckets in (self.requests, self.tokens):
            if len(buckets) >= PRUNE_AT:
                now = self.clock()
                for client in [c for c, b in buckets.items() if (b.refill(now), b.full)[1]]:
                    del buckets[client]


UNITS = {"requests_per_s": "requests per second", "tokens_per_min": "tokens per minute"}


def rate_limited(config: RateLimitsConfig, limit: str, retry_after_s: float) -> APIError:
    """The 429 of a refused request; Retry-After in whole seconds, at least 1."""
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, f"rate limit reached: this client may send {getattr(config, limit):g} "
                    f"{UNITS[limit]} (router.rate_limits.{limit}); retry after {seconds} s",
                    type="rate_limit_exceeded", code="rate_limit_exceeded",
                    headers={"Retry-After": str(seconds)})
