"""RateLimiter deployment: every client's rate-limit buckets for the whole application.

One replica holds them all (`moonserve.pipeline.api.token_buckets.ClientBuckets`), so a client's
limits are the same whichever Router replica its requests reach. Routers call `acquire` before
reading a request's body and `charge` when it ends. A replica that restarts starts with full
buckets: for a moment clients may send more than their limit, never less.

Example (without Serve):
    >>> limiter = RateLimiter(RateLimitsConfig(requests_per_s=1))
    >>> await limiter.acquire("key-digest")         # None: go ahead
    >>> await limiter.acquire("key-digest")         # ("requests_per_s", 1.0)
"""

from __future__ import annotations

from moonserve.pipeline.api.token_buckets import ClientBuckets
from moonserve.pipeline.config import RateLimitsConfig


class RateLimiter:
    def __init__(self, config: RateLimitsConfig):
        self.buckets = ClientBuckets(config)

    async def acquire(self, client: str) -> tuple[str, float] | None:
        """None when `client` may send a request now; else (the limit, seconds to wait)."""
        refusal = self.buckets.acquire(client)
        return None if refusal is None else (refusal.limit, refusal.retry_after_s)

    async def charge(self, client: str, num_tokens: int) -> None:
        self.buckets.charge(client, num_tokens)

    async def stats(self) -> dict:
        return {"num_clients": self.buckets.num_clients}
