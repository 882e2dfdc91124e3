"""configs/mi355x-k3.1-recipe.yaml is vLLM's AMD K3 recipe: the recipe's `vllm serve` command is
parsed by vLLM's own argument parser, and both engines are resolved by vLLM's
`create_engine_config` against the same synthetic K3 target and speculators-format DSpark draft
(pipeline/synthetic_checkpoints/k3.py); every setting the recipe decides must resolve the same.

The recipe: vllm-project/recipes models/moonshotai/Kimi-K3.yaml, commit 2c22f3f (date_updated
2026-08-14): base_args, the tool_calling, reasoning and (opt-in) spec_decoding features with its
AMD override, hardware_overrides.amd, at single_node_tp (TP 8). Its draft
RedHatAI/Kimi-K3-speculator.dspark stands here as a synthetic speculators-format draft.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import pytest
from moonserve.pipeline.config import load_app_config

from tests.conftest import REPO, vllm_config_parts

RECIPE = REPO / "configs" / "mi355x-k3.1-recipe.yaml"
PRODUCTION = REPO / "configs" / "mi355x-k3.1-pro.yaml"
RECIPE_SPECULATIVE_CONFIG = {  # features.spec_decoding.hardware_overrides.amd
    "num_speculative_tokens": 8, "method": "dspark", "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block"}


def recipe_command(target: Path, draft: Path) -> list[str]:
    """`vllm serve` arguments of the recipe, in its own order (later flags win, as on its site)."""
    speculative = json.dumps({"model": str(draft), **RECIPE_SPECULATIVE_CONFIG})
    return [
        "--model", str(target), "--tensor-parallel-size", "8",
        # base_args
        "--trust-remote-code", "--gpu-memory-utilization", "0.95",
        # features: tool_calling, reasoning, spec_decoding (amd)
        "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3",
        "--reasoning-parser", "kimi_k3",
        "--max-num-seqs", "128", "--speculative-config", speculative,
        # hardware_overrides.amd.extra_args
        "--load-format", "auto", "--gpu-memory-utilization", "0.95",
        "--mm-encoder-tp-mode", "data", "--max-num-seqs", "128",
        "--reasoning-parser", "kimi_k3", "--max-num-batched-tokens", "4096",
        "--compilation-config",
        '{"cudagraph_mode":"FULL_DECODE_ONLY","custom_ops":["+fused_rms_norm_gated"]}',
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from moonserve.pipeline.synthetic_checkpoints.k3 import (
        write_k3_config,
        write_speculators_dspark_config,
    )

    root = tmp_path_factory.mktemp("models")
    return (write_k3_config(root / "kimi-k3.1-pro"),
            write_speculators_dspark_config(root / "kimi-k3-speculator.dspark"))


@pytest.fixture(scope="module")
def recipe_args(checkpoints):
    """(the recipe's AsyncEngineArgs as `vllm serve` builds them, its frontend namespace)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(recipe_command(*checkpoints))
    return AsyncEngineArgs.from_cli_args(namespace), namespace


@pytest.fixture(scope="module")
def profile_args(checkpoints):
    """`engine_args` of the recipe profile, the checkpoint paths pointed at the synthetic ones."""
    from moonserve.deployments.language_model import engine_args

    app = load_app_config(RECIPE)
    target, draft = checkpoints
    assert (Path(app.language_model.engine.model).name, Path(app.draft.model).name) == \
        (target.name, draft.name)
    assert app.vision is None  # no ec_transfer_config: the engine is the recipe's alone
    return engine_args(app.language_model.engine, str(target),
                       app.draft.model_copy(update={"model": str(draft)}),
                       app.language_model.chat.reasoning.parser)


# What the recipe decides, read from the resolved configs. Left out, with why: the served model
# name, the executor (Ray's in a Serve replica, vLLM's mp on one host) and the structured-output
# backend (moonserve's STRUCTURED_OUTPUTS: xgrammar without free whitespace, pipeline/config.py).
SETTINGS = {  # name -> the attribute path in what VllmConfig gets
    "architecture": "model_config.architecture",
    "max_model_len": "model_config.max_model_len",
    "dtype": "model_config.dtype",
    "trust_remote_code": "model_config.trust_remote_code",
    "mm_encoder_tp_mode": "model_config.multimodal_config.mm_encoder_tp_mode",
    "kv_cache_dtype": "cache_config.cache_dtype",
    "enable_prefix_caching": "cache_config.enable_prefix_caching",
    "gpu_memory_utilization": "cache_config.gpu_memory_utilization",
    "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    "decode_context_parallel_size": "parallel_config.decode_context_parallel_size",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "scheduling_policy": "scheduler_config.policy",
    "long_prefill_token_threshold": "scheduler_config.long_prefill_token_threshold",
    "async_scheduling": "scheduler_config.async_scheduling",
    "load_format": "load_config.load_format",
    "cudagraph_mode": "compilation_config.cudagraph_mode",
    "custom_ops": "compilation_config.custom_ops",
    "reasoning_parser": "structured_outputs_config.reasoning_parser",
    "speculative_method": "speculative_config.method",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    "draft_architecture": "speculative_config.draft_model_config.architecture",
    "draft_attention_backend": "speculative_config.attention_backend",
    "draft_sample_method": "speculative_config.draft_sample_method",
    "rejection_sample_method": "speculative_config.rejection_sample_method",
    "draft_tensor_parallel_size": "speculative_config.draft_tensor_parallel_size",
}


def settings(parts: dict) -> dict:
    """Every SETTINGS value read from `vllm_config_parts`' result."""
    return {name: attrgetter(path)(SimpleNamespace(**parts)) for name, path in SETTINGS.items()}


def test_vllm_resolves_the_recipe_profile_as_it_resolves_the_recipe(recipe_args, profile_args):
    recipe = settings(vllm_config_parts(recipe_args[0]))
    profile = settings(vllm_config_parts(profile_args))
    assert {name: (recipe[name], profile[name]) for name in SETTINGS
            if recipe[name] != profile[name]} == {}
    # What that is: the recipe's engine, not the full profile's.
    assert (profile["kv_cache_dtype"], profile["enable_prefix_caching"],
            profile["gpu_memory_utilization"]) == ("auto", True, 0.95)
    assert (profile["num_speculative_tokens"], profile["draft_architecture"],
            profile["draft_attention_backend"]) == (8, "Qwen3DSparkModel", None)


def test_the_full_profile_differs_from_the_recipe_where_bring_up_says(checkpoints, recipe_args):
    """docs/bring-up.md adds these to the recipe, one step each; nothing else may differ."""
    from moonserve.deployments.language_model import ImageInput, engine_args
    from moonserve.pipeline.engine.image_format import image_format
    from moonserve.pipeline.synthetic_checkpoints.k3 import write_dspark_config

    app = load_app_config(PRODUCTION)
    target = checkpoints[0]
    draft = write_dspark_config(target.parent / "kimi-k3.1-pro-dspark")
    full = vllm_config_parts(engine_args(
        app.language_model.engine, str(target), app.draft.model_copy(update={"model": str(draft)}),
        app.language_model.chat.reasoning.parser,
        ImageInput(app.vision.encoder.store, app.router.limits.max_images),
        image_format(target).modality))
    recipe = vllm_config_parts(recipe_args[0])
    recipe_settings, full_settings = settings(recipe), settings(full)
    assert {name for name in SETTINGS if recipe_settings[name] != full_settings[name]} == {"kv_cache_dtype", "gpu_memory_utilization",
                      "scheduling_policy", "long_prefill_token_threshold",
                      "num_speculative_tokens", "draft_architecture", "draft_attention_backend"}
    # And the images: the full profile's engine reads the VisionEncoder's outputs (step 1).
    assert full["ec_transfer_config"].is_ec_consumer
    assert recipe.get("ec_transfer_config") is None
    # The replica's start line shows each (test_the_replicas_start_line_says_what_vllm_resolved).
    from moonserve.deployments.language_model import resolved_summary

    line = resolved_summary(SimpleNamespace(**full))
    for shown in ("kv_cache_dtype=fp8", "gpu_memory_utilization=0.9", "policy=priority",
                  "long_prefill_token_threshold=2048", "draft=dspark k=7 K3DSparkModel "
                  "backend=TRITON_MLA", "ec_transfer=ec_consumer MoonserveECConnector"):
        assert shown in line


def test_the_recipe_profile_uses_the_recipes_tool_and_reasoning_parsers(recipe_args):
    namespace = recipe_args[1]
    chat = load_app_config(RECIPE).language_model.chat
    assert namespace.enable_auto_tool_choice
    assert (chat.tools.parser, chat.reasoning.parser) == \
        (namespace.tool_call_parser, namespace.reasoning_parser)
    assert chat.tools.strict_level == namespace.tool_strict_level  # vLLM's server default


def situv2_activations(*envs: dict[str, str]) -> list[dict]:
    """What vLLM's AITER ops make of each env (vllm/_aiter_ops.py: the MoE activation, and the
    AITER_SITUV2_* variables it leaves for AITER), in one subprocess: the import rewrites them."""
    script = """
import json, os, sys
import vllm._aiter_ops as ops
results = []
for env in json.loads(sys.argv[1]):
    for name in [n for n in os.environ if n.startswith(("AITER_", "VLLM_ROCM_"))]:
        del os.environ[name]
    os.environ.update(env)
    ops._sync_aiter_situv2_moe_env()
    results.append({"activation": ops._resolve_situv2_activation(),
                    "aiter": sorted(n for n in os.environ if n.startswith("AITER_SITUV2"))})
print(json.dumps(results))
"""
    clean = {n: v for n, v in os.environ.items() if not n.startswith(("AITER_", "VLLM_ROCM_"))}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(envs)], env=clean,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_recipes_moe_env_runs_a4w4_in_this_vllm_and_the_full_profile_a8w4():
    """The recipe sets VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1, which this vLLM does not read: its
    import selects a4w4 and removes AITER_SITUV2_A8W4. The full profile names the activation
    (VLLM_ROCM_USE_AITER_MOE_SITUV2=a8w4), bring-up's step 7."""
    recipe = load_app_config(RECIPE).language_model.env
    full = load_app_config(PRODUCTION).language_model.env
    assert recipe["VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4"] == "1"
    assert situv2_activations(recipe, full) == [
        {"activation": "a4w4", "aiter": ["AITER_SITUV2_A4W4"]},
        {"activation": "a8w4", "aiter": ["AITER_SITUV2_A8W4"]}]


def test_the_replicas_start_line_says_what_vllm_vllm_config_parts(recipe_args, profile_args, checkpoints):
    """`resolved_summary`, logged by each LanguageModel replica at start, reads vLLM's resolved
    configs (here the sub-configs VllmConfig gets), so docs/bring-up.md's steps can be checked in
    the replica's log."""
    from moonserve.deployments.language_model import resolved_summary

    line = resolved_summary(SimpleNamespace(**vllm_config_parts(profile_args)))
    assert line.startswith("moonserve LanguageModel engine: architecture="
                           "KimiK3ForConditionalGeneration, tp=8, dcp=1, max_model_len=1048576, "
                           "kv_cache_dtype=auto, prefix_caching=True")
    assert "draft=dspark k=8 Qwen3DSparkModel backend=auto" in line
    assert "policy=fcfs" in line and "ec_transfer=none" in line
