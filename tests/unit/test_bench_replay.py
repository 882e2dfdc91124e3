"""`moonserve bench replay` without engines: the trace scaled into a workload, its arms' configs,
and the goodput arithmetic."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from moonserve.pipeline.bench import replay
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args


def args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args(["--trace", "t.jsonl",
                              *(f"--{k.replace('_', '-')}={v}" for k, v in over.items())])


def write_trace(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(ms: int, ids: list[int], out: int = 160) -> dict:
    return {"timestamp": ms, "input_length": 512 * len(ids), "output_length": out,
            "hash_ids": ids}


def test_sessions_are_chosen_whole_and_their_shared_blocks_are_shared_tokens(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [
        row(1000, [0, 1, 2]),            # session (0, 1): three turns, each extending the last
        row(2000, [0, 5]),               # session (0, 5): one turn only, never chosen
        row(3000, [0, 1, 2, 3], out=2000),
        row(4000, [0, 7, 8]),            # session (0, 7): two turns
        row(9000, [0, 1, 2, 3, 4], out=1),
        row(9500, [0, 7, 8, 9]),
    ])
    requests = replay.workload(trace, args(sessions=2, min_turns=2, block_tokens=4,
                                           time_scale=0.5, output_scale=0.1,
                                           max_output_tokens=48), (100, 200))
    assert [r.trace_input_length // 512 for r in requests] == [3, 4, 3, 5, 4]
    assert [r.at_s for r in requests] == [0.0, 1.0, 1.5, 4.0, 4.25]
    assert [r.max_tokens for r in requests] == [16, 48, 16, 1, 16]
    assert all(len(r.prompt) == 4 * r.trace_input_length // 512 for r in requests)
    first, second = requests[0].prompt, requests[1].prompt
    assert second[:12] == first and second[12:] != first[-4:]  # shared blocks, a new one
    assert requests[2].prompt[:4] == first[:4]  # block 0, shared by every session
    assert requests[2].prompt[4:8] != first[4:8]
    assert all(100 <= t < 200 for r in requests for t in r.prompt)
    only_long = replay.workload(trace, args(sessions=5, min_turns=3), (100, 200))
    assert len(only_long) == 3  # the one session of three turns


def test_goodput_counts_answers_that_met_both_targets():
    outcomes = [replay.Outcome(True, 1.0, 0.1, 100, 60, 10),
                replay.Outcome(True, 4.0, 0.1, 100, 0, 10),   # TTFT over 3 s
                replay.Outcome(True, 1.0, 0.5, 100, 40, 10),  # TPOT over 250 ms
                replay.Outcome(error="HTTP 429: busy")]
    summary = replay.summarize(outcomes, wall_s=2.0, ttft_ms=3000, tpot_ms=250)
    assert summary["goodput_rps"] == 0.5 and summary["throughput_rps"] == 1.5
    assert summary["failed"] == 1 and summary["errors"] == ["HTTP 429: busy"]
    assert math.isclose(summary["prefix_cache_hit_rate"], 100 / 300)
    assert summary["output_tokens_per_s"] == 15.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_each_moonserve_arm_is_a_valid_app_config(replicas, tmp_path):
    path = write_with_args(DEFAULT_CONFIG, replay.moonserve_overrides(replicas),
                           tmp_path / "c.yaml")
    config = load_app_config(path)
    assert config.language_model.deployment.num_replicas == replicas
    assert config.draft.mode == "off"
    if replicas == 2:
        assert config.language_model.routing.policy == "prefix_affinity"
        assert config.language_model.env["OMP_NUM_THREADS"] == "1"
