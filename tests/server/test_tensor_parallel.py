"""The placement-group path for real on CPU: TP=3 on a 3-bundle placement group, same greedy tokens.

SmolLM2-135M has 9 attention heads and 3 KV heads, so TP=3 shards it for real. The app is deployed
as a second application on the session server's Ray cluster and removed afterwards. On CPU, vLLM
0.32 has no Ray executor (`CpuPlatform.ray_device_key` is empty), so the three TP workers are vLLM's
own processes inside the replica's reserved 3-bundle group; on GPUs the builder picks the Ray
executor and vLLM places one worker per bundle.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from moonserve.pipeline.config import AppConfig
from tests.conftest import LOCAL_CONFIG, MODEL

PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is"]


def tp3_config() -> AppConfig:
    args = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]
    lm = args["language_model"]
    lm["engine"]["tensor_parallel_size"] = 3
    lm["engine"]["kv_cache_memory_bytes"] = 256 << 20
    lm["placement"]["bundles"] = [{"CPU": 0.3}] * 3
    # 2 cores for 3 ranks: bind ranks to cores explicitly ("auto" needs a NUMA node per rank).
    lm["env"]["VLLM_CPU_OMP_THREADS_BIND"] = "0|1|0"
    del args["vision"]  # text only: no second pair of image deployments
    return AppConfig.model_validate(args)


@pytest.fixture(scope="module")
def tp3_app(server):
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from moonserve.deployments.builder import build_app

    server.lm_handle()  # joins the server's Ray cluster
    serve.run(build_app(tp3_config()), name="tp3", route_prefix="/tp3")
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    try:
        yield f"{server.base_url}/tp3", groups
    finally:
        serve.delete("tp3")


def greedy(base_url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_tp3_runs_on_a_three_bundle_placement_group(tp3_app):
    _, groups = tp3_app
    bundles = sorted(len(g["bundles"]) for g in groups)
    assert 3 in bundles, f"no 3-bundle placement group among {bundles}"
    three = next(g for g in groups if len(g["bundles"]) == 3)
    assert three["strategy"] == "STRICT_PACK"
    assert all(b == {"CPU": 0.3} for b in three["bundles"].values())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tp3_greedy_tokens_equal_tp1(server, tp3_app, prompt):
    base_url, _ = tp3_app
    assert greedy(base_url, prompt) == greedy(server.base_url, prompt)
