"""configs/mi355x-k3.1-pro.yaml: validated by the same AppConfig, and its app graph built (no
engine, no GPU) with the resources each deployment asks Ray for."""

from __future__ import annotations

import pytest

from moonserve.pipeline.config import load_app_config
from tests.conftest import REPO

PRODUCTION = REPO / "configs" / "mi355x-k3.1-pro.yaml"


def deployments_of(app) -> dict:
    """Every deployment of a bound application graph, by name."""
    from ray.serve.deployment import Application

    found, todo = {}, [app]
    while todo:
        deployment = todo.pop()._bound_deployment
        found[deployment.name] = deployment
        todo += [a for a in deployment.init_args if isinstance(a, Application)]
    return found


@pytest.fixture(scope="module")
def graph():
    from moonserve.deployments.builder import build_app

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONSERVE_API_KEYS", "sk-graph-test")  # auth is on in production
        return deployments_of(build_app(load_app_config(PRODUCTION)))


def test_production_config_validates_with_the_production_engine():
    cfg = load_app_config(PRODUCTION)
    engine = cfg.language_model.engine
    assert (engine.tensor_parallel_size, engine.decode_context_parallel_size) == (8, 8)
    assert (engine.max_model_len, engine.kv_cache_dtype, engine.scheduling_policy) == \
        (1_048_576, "fp8", "priority")
    assert cfg.router.auth.enabled and cfg.vision is not None


def test_graph_has_the_four_deployments(graph):
    assert set(graph) == {"Router", "LanguageModel", "ImagePreprocessor", "VisionEncoder"}
    # draft.mode inline: no DraftService deployment


def test_language_model_takes_a_whole_node_of_eight_gpus(graph):
    lm = graph["LanguageModel"]
    bundles = lm._replica_config.placement_group_bundles
    assert len(bundles) == 8 and all(b["GPU"] == 0.95 for b in bundles)
    assert bundles[0]["CPU"] == 1 and lm.ray_actor_options["num_cpus"] == 1
    assert lm._replica_config.placement_group_strategy == "STRICT_PACK"
    assert lm.ray_actor_options["runtime_env"]["env_vars"]["VLLM_RAY_PER_WORKER_GPUS"] == "0.95"
    scaling = lm._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 1)


def test_image_deployments_ask_for_cpu_and_a_gpu_share(graph):
    encoder, pre = graph["VisionEncoder"], graph["ImagePreprocessor"]
    assert encoder.ray_actor_options["num_gpus"] == 0.05
    # The encoder's share fits beside the LM's bundles on one GPU.
    lm_share = graph["LanguageModel"]._replica_config.placement_group_bundles[0]["GPU"]
    assert encoder.ray_actor_options["num_gpus"] + lm_share <= 1.0
    assert "num_gpus" not in pre.ray_actor_options and pre.ray_actor_options["num_cpus"] == 2
    assert pre._deployment_config.autoscaling_config.max_replicas == 8


def test_engine_arguments_reach_vllm_as_named(graph):
    from moonserve.deployments.language_model import engine_args

    app = load_app_config(PRODUCTION)
    cfg = app.language_model
    args = engine_args(cfg.engine, cfg.engine.model, app.draft)
    assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (8, 8)
    assert (args.kv_cache_dtype, args.scheduling_policy, args.max_model_len) == \
        ("fp8", "priority", 1_048_576)
    assert args.enable_prompt_embeds and args.long_prefill_token_threshold == 2048
    # vLLM's own scheduler, so vLLM keeps its async scheduling on GPUs (no LaneScheduler).
    assert args.scheduler_cls is None and args.async_scheduling is None
    # inline: vLLM's own DSpark drafter, weights from the target checkpoint
    assert args.speculative_config == {"method": "dspark", "num_speculative_tokens": 4}


def test_draft_service_variant_gets_its_own_gpu():
    from moonserve.deployments.builder import build_app

    app = load_app_config(PRODUCTION)
    draft = app.draft.model_copy(update={"mode": "service", "model": "/models/k3.1-dspark"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONSERVE_API_KEYS", "sk-graph-test")
        graph = deployments_of(build_app(app.model_copy(update={"draft": draft})))
    service = graph["DraftService"]
    assert service.ray_actor_options["num_gpus"] == 1
    assert service._deployment_config.num_replicas == 1
    lm_args = graph["LanguageModel"].init_args
    assert lm_args[2].mode == "service" and lm_args[3] is not None  # the handle the resolver asks
