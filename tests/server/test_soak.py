"""A short soak (`moonserve bench soak`'s code) against the session server: the whole mix, nothing
lost, no unexpected 5xx, bad requests answered 4xx, and the object store back to its level after
the load (it was not while the VisionEncoder's batch held a zero-copy view of an image's pixels).
The 20-minute run and its RSS figures are in docs/benchmarks.md."""

from __future__ import annotations

import asyncio
import json

from moonserve.pipeline.bench.soak import KINDS, Options, soak
from tests.conftest import MODEL


def test_a_short_soak_of_the_whole_mix_loses_nothing(server):
    options = Options(duration_s=30, warmup_s=10, concurrency=3, sample_s=5, settle_s=40,
                      timeout_s=120, seed=1)
    result = asyncio.run(soak(server.process, server.metrics_url, MODEL, options))
    summary = {k: v for k, v in result.items() if k != "samples"}
    assert set(result["requests"]) == set(KINDS), summary
    # As text: pytest cuts a dict's repr, and the losses' details are what a failure needs.
    assert result["lost"] == 0, (f"lost: {json.dumps(result['losses'], indent=1)}\n"
                                 f"requests: {result['requests']}\n"
                                 f"server log:\n{server.process.log_tail(80)}")
    assert result["unexpected_5xx"] == 0, summary
    assert result["requests"]["bad"] == {"rejected": result["requests"]["bad"]["rejected"]}, summary
    assert result["requests"]["cancel"].get("cancelled"), summary
    assert result["goals"]["object_store_back_to_baseline"], summary
    titles = {name.split(" ")[0] for name in result["rss"]}
    assert {"ray::ServeReplica:moonserve:Router", "ray::ServeReplica:moonserve:LanguageModel",
            "raylet"} <= titles, titles
