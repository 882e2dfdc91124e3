"""The placement-group path for real on CPU: TP=2 on a 2-bundle placement group, same greedy tokens.

The tiny model's 2 attention heads shard 2 ways (its one KV head is replicated on each rank, as
vLLM does when TP exceeds the KV heads). The app is deployed as a second application on the
session server's Ray cluster and removed afterwards. On CPU, vLLM 0.32 has no Ray executor
(`CpuPlatform.ray_device_key` is empty), so the TP workers are vLLM's own processes inside the
replica's reserved group; on GPUs the builder picks the Ray executor and vLLM places one worker
per bundle.
"""

from __future__ import annotations

import httpx
import pytest

from moonserve.pipeline.config import AppConfig
from tests.conftest import MODEL

PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is"]
TP = 2


def tp_config(args: dict) -> AppConfig:
    lm = args["language_model"]
    lm["engine"]["tensor_parallel_size"] = TP
    lm["engine"]["kv_cache_memory_bytes"] = 256 << 20
    lm["placement"]["bundles"] = [{"CPU": 0.3}] * TP
    # The ranks' one OpenMP thread each, on the cores this test worker may use ("auto" needs a
    # NUMA node per rank).
    lm["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    del args["vision"]  # text only: no second pair of image deployments
    return AppConfig.model_validate(args)


@pytest.fixture(scope="module")
def tp_app(server):
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from moonserve.deployments.builder import build_app

    server.lm_handle()  # joins the server's Ray cluster
    serve.run(build_app(tp_config(server.args())), name="tp", route_prefix="/tp")
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    try:
        yield f"{server.base_url}/tp", groups
    finally:
        serve.delete("tp")


def greedy(base_url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_tp_runs_on_a_placement_group_of_one_bundle_per_rank(tp_app):
    _, groups = tp_app
    bundles = sorted(len(g["bundles"]) for g in groups)
    assert TP in bundles, f"no {TP}-bundle placement group among {bundles}"
    group = next(g for g in groups if len(g["bundles"]) == TP)
    assert group["strategy"] == "STRICT_PACK"
    assert all(b == {"CPU": 0.3} for b in group["bundles"].values())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tp_greedy_tokens_equal_tp1(server, tp_app, prompt):
    base_url, _ = tp_app
    assert greedy(base_url, prompt) == greedy(server.base_url, prompt)
