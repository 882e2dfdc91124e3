"""Calls a replica starts and does not wait for, held until they end.

asyncio's loop holds tasks weakly: a task nobody refers to may be collected before it ends. With
Serve's router on the replica's own loop (`RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`, as in Serve's
throughput-optimized mode) a handle call is such a task, referred to only by its response.
`in_background` keeps the task until it ends, and logs a failure nobody waited for.

Example (inside a replica's event loop):
    >>> in_background(rate_limiter.charge.remote("client-a", 120))     # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

logger = logging.getLogger("moonserve.background")

RUNNING: set[asyncio.Future] = set()


def in_background(call: Awaitable, what: str = "background call") -> asyncio.Future:
    """Run `call` (a coroutine, or a Serve handle's response) without waiting for it."""
    task = asyncio.ensure_future(call)
    RUNNING.add(task)
    task.add_done_callback(lambda done: _finished(done, what))
    return task


def _finished(task: asyncio.Future, what: str) -> None:
    RUNNING.discard(task)
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
