"""A short overload burst against the running app: every request completes or is refused fast
with 429/503 + Retry-After; none is lost; the server answers normally afterwards.
(`moonserve bench reliability` is the long, 5x-capacity version.)"""

from __future__ import annotations

import asyncio
import time

from moonserve.pipeline.bench.reliability import overload
from tests.conftest import MODEL


def test_overload_burst_loses_nothing_and_the_server_recovers(server, client):
    url = f"{server.base_url}/v1/chat/completions"
    # ~30 requests/s for 6 s, each 16 steps of 100 ms (drafts off): the engine serves 16 of them
    # in 1.6 s, so the interactive lane's 16 in flight + 64 queued fill in about 3 s.
    with server.paced(0.1), server.drafter("none"):
        outcomes = asyncio.run(overload(url, MODEL, rate=30, seconds=6, timeout_s=120))
    print(f"\noverload burst: {outcomes.summary()}")
    assert outcomes.lost == 0, outcomes.summary()
    assert outcomes.completed + outcomes.rejected == outcomes.sent
    assert outcomes.rejected > 0 and outcomes.completed > 0
    began = time.monotonic()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert r.choices[0].message.content and time.monotonic() - began < 10
