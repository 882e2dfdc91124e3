"""`moonserve bench routing` without engines: its workload, its configs and its arithmetic."""

from __future__ import annotations

import argparse

import pytest

from moonserve.pipeline.bench import routing
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args


def args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in over.items()])


def test_conversations_share_system_prompts_and_images_and_repeat_per_seed():
    chats = routing.conversations(args(conversations=12, image_fraction=0.5))
    assert len(chats) == 12 and len({c.system for c in chats}) == 2
    assert all(4 <= len(c.turns) <= 8 for c in chats)
    assert len({c.turns[0] for c in chats}) == 12  # each opens on its own question
    images = [c.image for c in chats if c.image]
    assert images and len(set(images)) <= 2 < len(images)  # shared by several conversations
    again = routing.conversations(args(conversations=12, image_fraction=0.5))
    assert [c.turns for c in again] == [c.turns for c in chats]


@pytest.mark.parametrize("arm", list(routing.ARMS))
def test_every_arm_is_a_valid_app_config(arm, tmp_path):
    path = write_with_args(DEFAULT_CONFIG, routing.arm_overrides(routing.ARMS[arm]),
                           tmp_path / "c.yaml")
    config = load_app_config(path)
    assert config.language_model.deployment.num_replicas == routing.ARMS[arm]["replicas"]
    assert config.language_model.routing.policy == routing.ARMS[arm]["policy"]
    assert config.draft.mode == "off" and config.vision is not None


def test_summary_counts_hits_per_replica_deltas_and_goals():
    before = {"a": {"prefix_cache_queries": 100, "prefix_cache_hits": 50, "num_requests": 3}}
    after = {"a": {"prefix_cache_queries": 300, "prefix_cache_hits": 200, "num_requests": 9},
             "b": {"prefix_cache_queries": 200, "prefix_cache_hits": 50, "num_requests": 4}}
    records = [{"turn": t, "ttft_s": 0.1 * (t + 1), "tokens": 10} for t in range(4)]
    summary = routing.summarize(records, 2.0, before, after)
    assert summary["prefix_cache_hit_rate"] == 200 / 400
    assert summary["requests_per_replica"] == {"a": 6, "b": 4}
    assert summary["load_ratio"] == 1.5 and summary["output_tokens_per_s"] == 20
    assert summary["later_turns_ttft_ms_p50"] == pytest.approx(300)
    goals = routing.goals({"prefix_affinity": summary,
                           "one_replica": {**summary, "prefix_cache_hit_rate": 0.625},
                           "power_of_two": {**summary, "ttft_ms_p50": 500.0}})
    assert goals["hit_rate_vs_one_replica"] == pytest.approx(0.8)
    assert goals["ttft_p50_vs_power_of_two"] == pytest.approx(summary["ttft_ms_p50"] / 500)
