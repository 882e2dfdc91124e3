"""`in_background`: calls a replica does not wait for are held until they end, and a failure
nobody waited for is logged once, not left to asyncio's "exception was never retrieved"."""

from __future__ import annotations

import asyncio
import logging

from moonserve.pipeline.api.background import RUNNING, in_background


async def test_a_call_is_held_until_it_ends_then_let_go():
    finished = asyncio.Event()

    async def call():
        await asyncio.sleep(0.01)
        finished.set()
        return 1

    task = in_background(call())
    assert task in RUNNING
    await asyncio.wait_for(finished.wait(), 1)
    await asyncio.sleep(0)  # the done callback runs on the next turn
    assert task not in RUNNING and task.result() == 1


async def test_a_failed_call_is_logged_with_what_it_was(caplog):
    async def charge():
        raise ConnectionError("rate limiter gone")

    with caplog.at_level(logging.WARNING, logger="moonserve.background"):
        task = in_background(charge(), "rate limit charge")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert "rate limit charge failed: ConnectionError: rate limiter gone" in caplog.text
    assert task not in RUNNING


async def test_a_cancelled_call_is_not_a_failure(caplog):
    with caplog.at_level(logging.WARNING, logger="moonserve.background"):
        task = in_background(asyncio.sleep(10))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert caplog.text == "" and task not in RUNNING
