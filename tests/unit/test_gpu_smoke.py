"""The CPU-runnable parts of the GPU smoke run (pipeline/bench/gpu_smoke.py): the tiny checkpoints it
writes, the one-GPU serve config it derives from the production YAML, and its `skipped: no CUDA
device` answer on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from safetensors import safe_open
from vllm.config.compilation import CUDAGraphMode

from moonserve.pipeline.bench import gpu_smoke
from moonserve.pipeline.capacity.checkpoint import check_checkpoint
from moonserve.pipeline.capacity.kimi_k3_layout import KimiCheckpointConfig, expected_tensors
from moonserve.pipeline.config import load_app_config
from moonserve.pipeline.engine import vllm_plugin
from moonserve.pipeline.synthetic_checkpoints.k3_random_weights import (
    SMOKE_DIMS,
    dspark_expected_tensors,
    write_random_weights,
    write_smoke_configs,
)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_smoke")
    k3_dir, dspark_dir = root / "k3", root / "dspark"
    write_smoke_configs(k3_dir, dspark_dir)
    for directory in (k3_dir, dspark_dir):
        write_random_weights(directory, constant_logits=True)  # as the smoke run writes them
    return k3_dir, dspark_dir


def stored(path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor in a model.safetensors."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                for name in f.keys()}


def test_k3_checkpoint_holds_exactly_the_layout_tensors(checkpoints):
    k3_dir, _ = checkpoints
    config = json.loads((k3_dir / "config.json").read_text())
    layout = expected_tensors(KimiCheckpointConfig.from_dict(config), tensor_parallel_size=1)
    tensors = stored(k3_dir)
    assert {name: shape for name, (shape, _) in tensors.items()} == \
        {t.name: t.shape for t in layout}
    fp32 = {n for n in tensors if n.endswith(("e_score_correction_bias", "A_log", "dt_bias"))}
    assert fp32 and {tensors[n][1] for n in fp32} == {"F32"}
    assert {dtype for n, (_, dtype) in tensors.items() if n not in fp32} == {"BF16"}
    report = check_checkpoint(k3_dir, 1)
    assert report.ok, [p.message for p in report.problems]


def test_k3_checkpoint_takes_the_nvidia_k3_paths(checkpoints):
    """Both layer kinds, MoE with a shared expert, and the fields vLLM's NVIDIA K3 asserts."""
    text = json.loads((checkpoints[0] / "config.json").read_text())["text_config"]
    names = stored(checkpoints[0])
    assert text["mla_use_nope"] is True and text["linear_attn_config"]["use_full_rank_gate"]
    assert "language_model.model.layers.0.self_attn.g_proj.weight" in names  # KDA, full-rank gate
    assert "language_model.model.layers.3.self_attn.kv_b_proj.weight" in names  # MLA
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # dense layer
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in names
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (512, 64)


def test_checkpoints_load_as_vllms_config_classes(checkpoints):
    from vllm.transformers_utils.config import get_config

    k3 = get_config(str(checkpoints[0]), trust_remote_code=False)
    assert type(k3).__name__ == "KimiK3Config"
    assert (k3.text_config.hidden_size, k3.text_config.num_hidden_layers) == \
        (SMOKE_DIMS.hidden_size, SMOKE_DIMS.num_hidden_layers)
    assert k3.text_config.linear_attn_config["head_dim"] == SMOKE_DIMS.kda_head_dim
    assert k3.vision_config.hidden_size == SMOKE_DIMS.vt_hidden_size
    draft = get_config(str(checkpoints[1]), trust_remote_code=False)
    assert type(draft).__name__ == "K3DSparkConfig" and draft.architectures == ["K3DSparkModel"]
    assert draft.hidden_size == k3.text_config.hidden_size  # it shares the target's embedding


def test_dspark_checkpoint_holds_what_the_draft_loader_reads(checkpoints):
    _, dspark_dir = checkpoints
    config = json.loads((dspark_dir / "config.json").read_text())
    tensors = stored(dspark_dir)
    assert {n: s for n, (s, _) in tensors.items()} == dspark_expected_tensors(config)
    assert tensors["context_proj.weight"][0] == (
        config["hidden_size"], config["target_hidden_size"] * len(config["target_layer_ids"]))
    assert not any("embed_tokens" in n or "lm_head" in n for n in tensors)  # the target's


def test_serve_config_fits_one_gpu_and_points_at_the_tiny_checkpoints(checkpoints, tmp_path):
    k3_dir, dspark_dir = checkpoints
    rec = gpu_smoke.Recorder()
    path = gpu_smoke.write_serve_config(rec, tmp_path, k3_dir, dspark_dir, port=8061)
    assert path is not None, rec.checks
    assert rec.checks[0]["check"] == "pro:config.serve"
    config = load_app_config(path)
    engine = config.language_model.engine
    assert (engine.tensor_parallel_size, engine.decode_context_parallel_size) == (1, 1)
    assert engine.model == str(k3_dir) and config.vision.encoder.model == str(k3_dir)
    assert config.draft.model == str(dspark_dir) and config.draft.draft_sample_method == "greedy"
    assert engine.worker_extension_cls == gpu_smoke.PROBE
    assert len(config.language_model.placement.bundles) == 1
    assert [k.get_secret_value() for k in config.router.auth.api_keys] == [gpu_smoke.API_KEY]
    assert not any(k.startswith(gpu_smoke.ROCM_ENV_PREFIXES) for k in config.language_model.env)
    production = load_app_config(gpu_smoke.PRODUCTION_CONFIG)
    assert engine.kv_cache_dtype == production.language_model.engine.kv_cache_dtype
    assert yaml.safe_load(path.read_text())["http_options"]["port"] == 8061


def test_serve_config_failure_is_a_failed_line(checkpoints, tmp_path):
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(gpu_smoke.PRODUCTION_CONFIG.read_text())
    data["applications"][0]["args"]["language_model"]["engine"]["no_such_key"] = 1
    bad.write_text(yaml.safe_dump(data))
    rec = gpu_smoke.Recorder()
    assert gpu_smoke.write_serve_config(rec, tmp_path, *checkpoints, 8061, bad) is None
    (line,) = rec.checks
    assert line["check"] == "pro:config.serve" and line["status"] == "failed"
    assert "no_such_key" in line["reason"]


def test_without_cuda_the_script_reports_skipped(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-m", "moonserve.pipeline.bench.gpu_smoke", "--out",
                            str(out), "--workdir", str(tmp_path / "work")], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == gpu_smoke.EXIT_NO_CUDA, child.stderr[-2000:]
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert lines == [{"check": "env.cuda", "status": "skipped", "reason": "skipped: no CUDA device",
                      "torch": torch.__version__, "torch_cuda": None}]
    summary = json.loads(out.read_text())
    assert summary["exit_code"] == 3 and summary["passed"] is False and summary["checks"] == lines


def test_every_profile_and_the_tp2_variant_get_a_valid_small_gpu_config(checkpoints, tmp_path):
    rec = gpu_smoke.Recorder()
    paths = {name: gpu_smoke.write_serve_config(rec, tmp_path, *checkpoints, 8061,
                                                gpu_smoke.PROFILES[profile], None, name, tp, draft)
             for name, profile, tp, draft in gpu_smoke.variants(["pro", "recipe"], every=True)}
    assert [c["status"] for c in rec.checks] == ["passed"] * 5, rec.checks
    assert set(paths) == {"pro", "recipe", "pro-service", "pro-service-context", "pro-tp2"}
    recipe, tp2 = load_app_config(paths["recipe"]), load_app_config(paths["pro-tp2"])
    assert recipe.vision is None and recipe.draft.attention_backend is None
    assert recipe.draft.model == str(checkpoints[1])
    assert tp2.language_model.engine.tensor_parallel_size == 2
    assert len(tp2.language_model.placement.bundles) == 2
    service = load_app_config(paths["pro-service"])
    assert (service.draft.mode, service.draft.drafter, service.draft.num_gpus) == \
        ("service", "ngram", 0)
    assert service.draft.speculative_config()["model"] == vllm_plugin.SERVICE_PROPOSER
    assert service.language_model.engine.worker_extension_cls == gpu_smoke.PROBE
    context = load_app_config(paths["pro-service-context"])
    assert (context.draft.drafter, context.draft.model) == ("dspark_context", str(checkpoints[1]))
    assert not context.language_model.engine.enforce_eager  # V2 keeps its graphs
    # The drafter on CUDA in what the LM's bundle and the VisionEncoder leave of the one GPU.
    bundle_gpu = context.language_model.placement.bundles[0]["GPU"]
    assert 0 < context.draft.num_gpus <= 1 - bundle_gpu - context.vision.encoder.num_gpus


def test_the_draft_gpu_share_check_wants_the_lms_gpu_and_memory_within_the_cap():
    workers = [{"gpu_uuid": "GPU-a"}, {"gpu_uuid": "GPU-b"}]
    draft = {"gpu_uuid": "GPU-b", "gpu_peak_reserved_bytes": 3 << 20,
             "gpu_memory_cap_bytes": 4 << 30}
    assert gpu_smoke.judge_draft_gpu_share(draft, workers)[0]
    for wrong in ({"gpu_uuid": "GPU-c"}, {"gpu_uuid": None}, {"gpu_peak_reserved_bytes": 0},
                  {"gpu_peak_reserved_bytes": 5 << 30}):
        ok, detail = gpu_smoke.judge_draft_gpu_share({**draft, **wrong}, workers)
        assert not ok and detail["reason"], wrong


def test_the_context_rows_check_wants_every_accepted_token_once():
    usage = SimpleNamespace(prompt_tokens=20, completion_tokens=16)
    assert gpu_smoke.judge_context_rows({"num_context_rows": 5}, {"num_context_rows": 40},
                                        usage)[0]
    for rows in (39, 41):  # a token short (the anchor's row counted), one twice
        assert not gpu_smoke.judge_context_rows({"num_context_rows": 0},
                                                {"num_context_rows": rows}, usage)[0]


def v1_runner_report(speculator):
    """`WorkerProbe.runner_report` on vLLM's V1 model runner (not constructed: the report reads
    its class, its speculator and its config only)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from moonserve.pipeline.engine.worker_probe import WorkerProbe

    runner = object.__new__(GPUModelRunner)
    runner.drafter = speculator
    runner.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY))
    probe = object.__new__(WorkerProbe)
    probe.model_runner = runner
    return probe.runner_report()


def test_the_v2_speculator_check_fails_on_vllms_fallback_to_v1():
    """What a worker that fell back to model runner V1 (vLLM's answer to custom_class without the
    plugin's hook) reports fails the check; the same report from V2 with the speculator passes."""
    from moonserve.pipeline.engine.proposer import ServiceProposer

    v1 = v1_runner_report(object.__new__(ServiceProposer))
    assert v1["model_runner_mro"][0] == "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
    assert v1["speculator"] == vllm_plugin.SERVICE_PROPOSER
    assert v1["cudagraph_mode"] == "FULL_DECODE_ONLY"
    ok, detail = gpu_smoke.judge_speculator([v1])
    assert not ok and "reason" in detail
    v2 = {**v1, "model_runner_mro": [gpu_smoke.V2_RUNNER, "builtins.object"],
          "speculator": gpu_smoke.SERVICE_SPECULATOR}
    assert gpu_smoke.judge_speculator([v2]) == (True, {"workers": [v2]})
    assert not gpu_smoke.judge_speculator([v2, {**v2, "cudagraph_mode": "NONE"}])[0]
    assert not gpu_smoke.judge_speculator([])[0]


def test_the_smoke_checkpoints_have_constant_logits(checkpoints):
    """Zero LM head (shared by the draft) and zero Markov head: every logit is 0, so greedy target
    and greedy draft agree and the smoke run can demand accepted drafts."""
    from safetensors.torch import load_file

    from moonserve.pipeline.synthetic_checkpoints.k3_random_weights import LOGIT_TENSORS

    for directory in checkpoints:
        tensors = load_file(str(directory / "model.safetensors"))
        logits = {n: t for n, t in tensors.items() if n.endswith(LOGIT_TENSORS)}
        assert logits and all(not t.any() for t in logits.values())
        assert any(t.any() for n, t in tensors.items() if n not in logits)


class Reply:
    """The parts of an `openai` ChatCompletion the tool judge reads."""

    def __init__(self, calls):
        from types import SimpleNamespace as NS

        self.choices = [NS(message=NS(tool_calls=[
            NS(function=NS(name=name, arguments=arguments)) for name, arguments in calls]))]


@pytest.mark.parametrize("calls, ok", [
    ([("get_weather", '{"city": "Paris"}')], True),
    ([("get_weather", '{"city": "Rome"}')], False),  # not in the enum
    ([("get_weather", '{"city": "Paris", "x": 1}')], False),
    ([("get_weather", '{"city": "Par')], False),  # cut
    ([("other", '{"city": "Paris"}')], False),
    ([], False),
])
def test_a_tool_call_passes_only_when_its_arguments_fit_the_schema(calls, ok):
    judged, details = gpu_smoke.judge_tool_call(Reply(calls), gpu_smoke.TOOLS[0])
    assert judged is ok and ("reason" in details) is (not ok)


@pytest.mark.parametrize("stats, ok", [
    ({"num_drafts": 5, "num_draft_tokens": 35, "num_accepted_tokens": 35}, True),
    ({"num_drafts": 5, "num_draft_tokens": 35, "num_accepted_tokens": 0}, False),
    ({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}, False),
    ({}, False),
])
def test_drafts_pass_only_when_proposed_and_accepted(stats, ok):
    assert gpu_smoke.judge_drafts(stats)[0] is ok


@pytest.mark.parametrize("report, ok", [
    ({"encoder_calls": 0, "prefills": [{"input_ids": [1], "image_rows": [[0.5]]}]}, True),
    ({"encoder_calls": 1, "prefills": [{"input_ids": [1], "image_rows": [[0.5]]}]}, False),
    ({"encoder_calls": 0, "prefills": []}, False),
])
def test_the_tower_check_needs_zero_lm_tower_runs_and_image_rows(report, ok):
    assert gpu_smoke.judge_tower(report)[0] is ok


def test_the_encoder_waits_for_the_first_image_and_the_check_says_so(checkpoints, tmp_path):
    rec = gpu_smoke.Recorder()
    path = gpu_smoke.write_serve_config(rec, tmp_path, *checkpoints, 8061)
    scaling = load_app_config(path).vision.encoder.deployment.autoscaling
    assert (scaling.min_replicas, scaling.upscale_delay_s) == (0, 0)
    assert gpu_smoke.judge_encoder_after_lm({"LanguageModel": 1, "VisionEncoder": 0})[0]
    assert not gpu_smoke.judge_encoder_after_lm({"LanguageModel": 1, "VisionEncoder": 1})[0]
    assert not gpu_smoke.judge_encoder_after_lm({"LanguageModel": 0, "VisionEncoder": 0})[0]
