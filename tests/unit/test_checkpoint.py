"""check-checkpoint on small Kimi-K3-shaped checkpoints written by safetensors, good and broken.

The tiny checkpoint (names as vLLM's Kimi K3 loader reads them, see pipeline/capacity/kimi_k3_layout.py):
4 layers, KDA at layers 1-3 (1-based) and MLA at layer 4; layer 0 has a dense MLP, layers 1-3 are
MoE with 8 routed experts (MXFP4 from kernels/mxfp4/naive.py) and 1 shared expert; MLA projections
in FP8; a 1-block vision tower. Three shards plus model.safetensors.index.json.
"""

from __future__ import annotations

import dataclasses
import doctest
import functools
import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moonserve.kernels.mxfp4.format
import moonserve.pipeline.capacity.checkpoint
import moonserve.pipeline.capacity.kimi_k3_layout
import moonserve.pipeline.models.weights
from moonserve.kernels.mxfp4.naive import quantize
from moonserve.pipeline.capacity.checkpoint import (
    check_checkpoint,
    format_report,
    report_to_dict,
)
from moonserve.pipeline.capacity.kimi_k3_layout import KimiCheckpointConfig, moe_intermediate_fraction
from moonserve.pipeline.capacity.plan import plan, with_checkpoint
from moonserve.pipeline.capacity.registry import HARDWARE, MODELS
from moonserve.pipeline.models.weights import INDEX_FILE, read_safetensors_header
from tests.conftest import run_cli

TP = 8
LM = "language_model."
TEXT_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
    "intermediate_size": 128, "num_experts": 8, "num_experts_per_token": 2,
    "moe_intermediate_size": 32, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "mla_use_nope": True,
    # Tiny experts: without this vLLM pads each rank's 4 intermediate rows up to 256.
    "min_moe_intermediate_per_partition": 4,
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 8,
                           "head_dim": 8, "short_conv_kernel_size": 4,
                           "use_full_rank_gate": True},
}
VISION_CONFIG = {
    "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
    "vt_num_attention_heads": 4, "vt_num_hidden_layers": 1, "vt_hidden_size": 32,
    "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2],
}
CONFIG = {
    "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": TEXT_CONFIG, "vision_config": VISION_CONFIG,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
}


# ---- building checkpoints ----------------------------------------------------------------------


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def add_kda(t: dict, p: str) -> None:
    for name in ("q", "k", "v", "g"):
        t[f"{p}{name}_proj.weight"] = bf16(64, 64)  # [8 heads * 8, hidden]
        if name != "g":
            t[f"{p}{name}_conv1d.weight"] = bf16(64, 1, 4)
    t[f"{p}b_proj.weight"] = bf16(8, 64)
    t[f"{p}f_a_proj.weight"] = bf16(8, 64)
    t[f"{p}f_b_proj.weight"] = bf16(64, 8)
    t[f"{p}A_log"] = torch.randn(8)
    t[f"{p}dt_bias"] = torch.randn(64)
    t[f"{p}o_norm.weight"] = bf16(8)
    t[f"{p}o_proj.weight"] = bf16(64, 64)


def fp8(t: dict, name: str, *shape: int) -> None:
    t[f"{name}.weight"] = torch.randn(*shape).to(torch.float8_e4m3fn)
    t[f"{name}.weight_scale"] = torch.ones(1)


def add_mla(t: dict, p: str) -> None:
    t[f"{p}q_a_proj.weight"] = bf16(32, 64)
    t[f"{p}q_a_layernorm.weight"] = bf16(32)
    fp8(t, f"{p}q_b_proj", 8 * 24, 32)  # heads * (nope 16 + rope 8), q_lora
    t[f"{p}kv_a_proj_with_mqa.weight"] = bf16(32 + 8, 64)
    t[f"{p}kv_a_layernorm.weight"] = bf16(32)
    fp8(t, f"{p}kv_b_proj", 8 * 32, 32)  # heads * (nope 16 + v 16), kv_lora
    fp8(t, f"{p}o_proj", 64, 8 * 16)


def mxfp4_expert(t: dict, name: str, out_dim: int, in_dim: int) -> None:
    blocks, scales = quantize(torch.randn(out_dim, in_dim))  # [N, K/32, 16], [N, K/32]
    t[f"{name}.weight_packed"] = blocks.flatten(-2)  # compressed-tensors: [N, K/2]
    t[f"{name}.weight_scale"] = scales


def add_mlp(t: dict, p: str, inter: int) -> None:
    t[f"{p}gate_proj.weight"] = bf16(inter, 64)
    t[f"{p}up_proj.weight"] = bf16(inter, 64)
    t[f"{p}down_proj.weight"] = bf16(64, inter)


def add_moe(t: dict, p: str) -> None:
    t[f"{p}gate.weight"] = bf16(8, 64)
    t[f"{p}gate.e_score_correction_bias"] = torch.randn(8)
    add_mlp(t, f"{p}shared_experts.", 32)
    for e in range(8):
        mxfp4_expert(t, f"{p}experts.{e}.w1", 32, 64)
        mxfp4_expert(t, f"{p}experts.{e}.w3", 32, 64)
        mxfp4_expert(t, f"{p}experts.{e}.w2", 64, 32)


def add_vision(t: dict) -> None:
    v = "vision_tower."
    t[f"{v}patch_embed.proj.weight"] = bf16(32, 3, 14, 14)
    t[f"{v}patch_embed.pos_emb.weight"] = bf16(4, 4, 32)
    b = f"{v}encoder.blocks.0."
    for name, shape in (("norm0", (32,)), ("norm1", (32,)), ("wqkv", (96, 32)), ("wo", (32, 32)),
                        ("mlp.fc0", (64, 32)), ("mlp.fc1", (32, 64))):
        t[f"{b}{name}.weight"] = bf16(*shape)
    t[f"{v}encoder.final_layernorm.weight"] = bf16(32)
    t["mm_projector.proj.0.weight"] = bf16(128, 128)  # checkpoint names; vLLM maps them
    t["mm_projector.proj.2.weight"] = bf16(64, 128)
    t["mm_projector.post_norm.weight"] = bf16(64)


def tiny_tensors() -> dict[str, torch.Tensor]:
    """A fresh dict (tests edit it) over tensors built once."""
    return dict(_tiny_tensors())


@functools.cache
def _tiny_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    t = {f"{LM}model.embed_tokens.weight": bf16(256, 64), f"{LM}lm_head.weight": bf16(256, 64),
         f"{LM}model.norm.weight": bf16(64)}
    for layer in range(4):
        p = f"{LM}layers.{layer}."  # HF prefix; vLLM maps it to language_model.model.layers.
        t[f"{p}input_layernorm.weight"] = bf16(64)
        t[f"{p}post_attention_layernorm.weight"] = bf16(64)
        (add_kda if layer < 3 else add_mla)(t, f"{p}self_attn.")
        if layer == 0:
            add_mlp(t, f"{p}mlp.", 128)
        else:
            add_moe(t, f"{p}block_sparse_moe.")
    add_vision(t)
    return t


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], num_shards: int = 3,
                     config: dict | None = CONFIG) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::num_shards]}
        save_file(part, str(root / shard))
        weight_map |= dict.fromkeys(part, shard)
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "tiny-k3", tiny_tensors())


def problem_kinds(report) -> set[str]:
    return {p.kind for p in report.problems}


def only_problem(report, kind: str) -> str:
    assert problem_kinds(report) == {kind}, format_report(report)
    return "\n".join(p.message for p in report.problems)


# ---- the valid checkpoint: hand-computed counts ------------------------------------------------

# (params, bytes, bytes per rank at TP=8) per (component, format, sharding).
EXPECTED_GROUPS = {
    ("embed_tokens", "bf16", "TP"): (256 * 64, 256 * 64 * 2, 32 * 64 * 2),  # 32 vocab rows/rank
    ("lm_head", "bf16", "TP"): (256 * 64, 256 * 64 * 2, 32 * 64 * 2),
    # 3 MoE layers * 8 experts * (w1 + w3 [32, 64] + w2 [64, 32]) = 147,456 params; bytes = half a
    # byte per param + one scale byte per 32 params = 73,728 + 4,608.
    ("routed_experts", "mxfp4", "TP"): (147_456, 78_336, 78_336 / 8),
    ("shared_experts", "bf16", "TP"): (3 * 3 * 32 * 64, 3 * 3 * 32 * 64 * 2, 36_864 / 8),
    ("moe_router", "bf16", "replicated"): (3 * 8 * 64, 3 * 8 * 64 * 2, 3 * 8 * 64 * 2),
    ("moe_router", "fp32", "replicated"): (3 * 8, 3 * 8 * 4, 3 * 8 * 4),
    ("dense_mlp", "bf16", "TP"): (3 * 128 * 64, 3 * 128 * 64 * 2, 49_152 / 8),
    # Per KDA layer: q, k, v, g 4 * 64 * 64 + b 8 * 64 + f_b 64 * 8 + convs 3 * 64 * 4 + o 64 * 64.
    ("kda_attention", "bf16", "TP"): (3 * 22_272, 3 * 22_272 * 2, 133_632 / 8),
    # f_a 8 * 64 and o_norm 8 are replicated.
    ("kda_attention", "bf16", "replicated"): (3 * (8 * 64 + 8), 3 * 520 * 2, 3 * 520 * 2),
    ("kda_attention", "fp32", "TP"): (3 * (8 + 64), 3 * 72 * 4, 864 / 8),  # A_log, dt_bias
    # q_b 192 * 32 + kv_b 256 * 32 + o 64 * 128 in FP8, plus three 4-byte per-tensor scales that
    # every rank keeps whole.
    ("mla_attention", "fp8", "TP"): (22_528, 22_528 + 12, 22_528 / 8 + 12),
    # q_a 32 * 64 + kv_a 40 * 64 + two 32-wide layernorms.
    ("mla_attention", "bf16", "replicated"): (4_672, 9_344, 9_344),
    ("norms", "bf16", "replicated"): (9 * 64, 9 * 64 * 2, 9 * 64 * 2),  # 2 per layer + final
    # patch 32*3*14*14 + pos 4*4*32 + block (2 norms, wqkv 96*32, wo, fc0, fc1) + final norm
    # + projector 128*128 + 64*128 + 64; 12 ViT heads-style: 4 heads do not divide TP=8.
    ("vision", "bf16", "replicated"): (52_256, 104_512, 104_512),
}


def test_valid_checkpoint_passes_with_exact_counts(tiny):
    report = check_checkpoint(tiny, tensor_parallel_size=TP)
    assert report.ok, format_report(report)
    assert report.warnings == ()
    got = {(g.component, g.format, g.sharding): (g.num_params, g.num_bytes, g.bytes_per_rank)
           for g in report.groups}
    assert got == EXPECTED_GROUPS  # all exact in binary floating point
    assert report.num_params == 373_416
    assert report.num_bytes == 508_220
    assert report.bytes_per_rank == pytest.approx(169_672)
    assert len(report.files) == 3 and report.model_type == "kimi_k3"


def test_valid_checkpoint_model_facts(tiny):
    facts = check_checkpoint(tiny).model
    assert (facts.num_experts, facts.num_experts_per_token) == (8, 2)
    assert (facts.num_kda_layers, facts.num_mla_layers) == (3, 1)
    assert (facts.kda_num_heads, facts.kda_head_dim, facts.kda_conv_kernel_size) == (8, 8, 4)
    assert (facts.kv_lora_rank, facts.qk_rope_head_dim) == (32, 8)


def test_tp1_holds_everything_on_one_rank(tiny):
    report = check_checkpoint(tiny, tensor_parallel_size=1)
    assert report.ok and report.bytes_per_rank == report.num_bytes == 508_220


def test_json_report_round_trips(tiny):
    d = report_to_dict(check_checkpoint(tiny))
    assert json.loads(json.dumps(d)) == d
    assert d["ok"] is True and d["num_params"] == 373_416


# ---- broken checkpoints: each gives its own error ----------------------------------------------


def test_deleted_shard(tiny):
    (tiny / "model-00002-of-00003.safetensors").unlink()
    message = only_problem(check_checkpoint(tiny), "missing_shard")
    assert "model-00002-of-00003.safetensors: missing" in message and INDEX_FILE in message


def test_truncated_file(tiny):
    shard = tiny / "model-00001-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    message = only_problem(check_checkpoint(tiny), "truncated")
    assert str(shard) in message and "ends at byte" in message and "truncated" in message


def test_header_length_beyond_file(tiny):
    shard = tiny / "model-00003-of-00003.safetensors"
    with shard.open("r+b") as f:
        f.write(struct.pack("<Q", 10**12))
    message = only_problem(check_checkpoint(tiny), "bad_header")
    assert str(shard) in message and "runs past the end" in message


def test_corrupted_header_json(tiny):
    shard = tiny / "model-00003-of-00003.safetensors"
    with shard.open("r+b") as f:
        f.seek(8)
        f.write(b"#")  # the header's opening brace
    message = only_problem(check_checkpoint(tiny), "bad_header")
    assert str(shard) in message and "not valid JSON" in message


def test_wrong_scale_shape(tmp_path):
    t = tiny_tensors()
    name = f"{LM}layers.2.block_sparse_moe.experts.5.w1.weight_scale"
    t[name] = torch.zeros(32, 3, dtype=torch.uint8)  # 64 inputs need 2 scales per row
    report = check_checkpoint(write_checkpoint(tmp_path / "ckpt", t))
    assert problem_kinds(report) == {"bad_scales", "missing_tensor"}
    bad = next(p.message for p in report.problems if p.kind == "bad_scales")
    assert name in bad and "[32, 3]" in bad and "[32, 32]" in bad


def test_missing_expert_tensor(tmp_path):
    t = tiny_tensors()
    base = f"{LM}layers.2.block_sparse_moe.experts.5.w3"
    del t[base + ".weight_packed"], t[base + ".weight_scale"]
    message = only_problem(check_checkpoint(write_checkpoint(tmp_path / "ckpt", t)),
                           "missing_tensor")
    assert "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight" in message
    assert "[moe_intermediate_size, hidden_size]" in message and "[32, 64]" in message


def test_blocks_without_scales(tmp_path):
    t = tiny_tensors()
    base = f"{LM}layers.1.block_sparse_moe.experts.0.w2"
    del t[base + ".weight_scale"]
    report = check_checkpoint(write_checkpoint(tmp_path / "ckpt", t))
    assert problem_kinds(report) == {"unpaired_blocks", "missing_tensor"}
    assert any(base + ".weight_packed" in p.message and "without scales" in p.message
               for p in report.problems)


def test_missing_index(tiny):
    (tiny / INDEX_FILE).unlink()
    message = only_problem(check_checkpoint(tiny), "missing_index")
    assert "3 .safetensors files" in message and INDEX_FILE in message


def test_mismatched_shape(tmp_path):
    t = tiny_tensors()
    t[f"{LM}layers.1.self_attn.o_proj.weight"] = bf16(64, 32)
    message = only_problem(check_checkpoint(write_checkpoint(tmp_path / "ckpt", t)), "bad_shape")
    assert "layers.1.self_attn.o_proj.weight: shape [64, 32], expected [64, 64]" in message
    assert "[hidden_size, num_heads * head_dim]" in message


def test_unexpected_dtypes(tmp_path):
    t = tiny_tensors()
    t[f"{LM}model.embed_tokens.weight"] = torch.zeros(256, 64, dtype=torch.int32)
    expert = f"{LM}layers.3.block_sparse_moe.experts.1.w2"
    del t[expert + ".weight_packed"], t[expert + ".weight_scale"]
    t[expert + ".weight"] = bf16(64, 32)  # unquantized, though the config says MXFP4
    messages = only_problem(check_checkpoint(write_checkpoint(tmp_path / "ckpt", t)), "bad_dtype")
    assert "embed_tokens.weight: stored as i32 (I32)" in messages
    assert "experts.1.w2.weight: stored as bf16" in messages and "MXFP4" in messages


def test_gpt_oss_block_view_under_compressed_tensors_names(tmp_path):
    t = tiny_tensors()
    name = f"{LM}layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    t[name] = t[name].unflatten(-1, (-1, 16))  # [32, 2, 16]: same bytes, gpt-oss's view
    message = only_problem(check_checkpoint(write_checkpoint(tmp_path / "ckpt", t)), "bad_shape")
    assert name in message and "reshape to [32, 32]" in message


def test_index_lists_a_tensor_its_shard_lacks(tiny):
    index = json.loads((tiny / INDEX_FILE).read_text())
    index["weight_map"]["language_model.model.extra.weight"] = "model-00001-of-00003.safetensors"
    (tiny / INDEX_FILE).write_text(json.dumps(index))
    message = only_problem(check_checkpoint(tiny), "index_mismatch")
    assert "model-00001-of-00003.safetensors" in message and "extra.weight" in message


def test_tp_that_does_not_divide_heads(tiny):
    message = only_problem(check_checkpoint(tiny, tensor_parallel_size=3), "bad_tp")
    assert "num_attention_heads=8" in message


def test_config_missing_a_field_names_it(tiny):
    config = json.loads((tiny / "config.json").read_text())
    del config["text_config"]["hidden_size"]
    (tiny / "config.json").write_text(json.dumps(config))
    message = only_problem(check_checkpoint(tiny), "bad_config")
    assert "config.json: text_config.hidden_size is missing" in message


# ---- without a Kimi config: gpt-oss-style blocks, headers only ---------------------------------


def gpt_oss_file(path: Path, scales_shape: tuple[int, ...] | None = None) -> Path:
    blocks, scales = quantize(torch.randn(4, 64, 64))  # [E, N, K/32, 16], [E, N, K/32]
    if scales_shape is not None:
        scales = torch.zeros(scales_shape, dtype=torch.uint8)
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
               "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
               "model.layers.0.mlp.router.weight": bf16(4, 64)}, str(path))
    return path


def test_gpt_oss_blocks_and_scales_pair(tmp_path):
    report = check_checkpoint(gpt_oss_file(tmp_path / "experts.safetensors"))
    assert report.ok and report.model_type is None and report.bytes_per_rank is None
    groups = {g.format: (g.num_weights, g.num_params, g.num_bytes) for g in report.groups}
    # 4 * 64 * 64 = 16,384 params in 8,192 block bytes + 512 scale bytes.
    assert groups == {"mxfp4": (1, 16_384, 8_704), "bf16": (1, 256, 512)}
    assert any("no config.json" in n for n in report.notes)


def test_gpt_oss_scales_that_do_not_fit(tmp_path):
    report = check_checkpoint(gpt_oss_file(tmp_path / "experts.safetensors", (4, 64, 3)))
    message = only_problem(report, "bad_scales")
    assert "gate_up_proj_scales [4, 64, 3] does not fit" in message and "[4, 64, 2, 16]" in message


# ---- headers only: no tensor data is read ------------------------------------------------------


def read_bytes_so_far() -> int:
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["rchar"])


def test_reader_never_reads_tensor_data(tmp_path):
    # A 1 TiB tensor in a sparse file: reading its data would take hours, not milliseconds.
    size = 1 << 40
    header = json.dumps({"huge": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
    os.truncate(path, 8 + len(header) + size)
    before, start = read_bytes_so_far(), time.perf_counter()
    (tensor,) = read_safetensors_header(path)
    report = check_checkpoint(path)
    elapsed, read = time.perf_counter() - start, read_bytes_so_far() - before
    assert tensor.nbytes == size and report.ok and report.num_bytes == size
    assert elapsed < 1.0 and read < 1 << 20


# ---- vLLM rules the tiny config does not reach -------------------------------------------------


def test_expert_padding_to_256_per_rank():
    text = dict(TEXT_CONFIG, min_moe_intermediate_per_partition=256)
    cfg = KimiCheckpointConfig.from_dict({"model_type": "kimi_linear", **text})
    # 32 / 8 = 4 rows per rank < 256: every rank allocates 256 rows, 8x the whole expert's.
    assert moe_intermediate_fraction(cfg.text, 8) == 8.0
    big = dataclasses.replace(cfg.text, moe_intermediate_size=2048)
    assert moe_intermediate_fraction(big, 8) == 1 / 8


# ---- feeding the planner -----------------------------------------------------------------------


def test_plan_uses_measured_weights_and_config_counts(tiny):
    model = with_checkpoint(MODELS["kimi-k3.1-pro"], check_checkpoint(tiny, tensor_parallel_size=8))
    p = plan(model, HARDWARE["mi355x"])
    assert p.weight_bytes_per_gpu == pytest.approx(169_672)
    assert p.total_params == 373_416 - 52_256  # vision excluded
    # Non-expert 173,704 + 147,456 routed * 2 of 8 active.
    assert p.activated_params == pytest.approx(173_704 + 147_456 * 2 / 8)
    # 1 MLA layer * (32 latent + 8 rope) * 1 B FP8 (vLLM's K3 MLA builds no indexer cache).
    assert p.kv_bytes_per_token == 40
    # 3 KDA layers * (8 heads * 8 * 8 * 4 B + 3 * 64 channels * 3 taps * 2 B).
    assert p.state_bytes_per_sequence == 3 * (2048 + 1152)
    measured = [a for a in p.assumptions if a.source.startswith("measured:")]
    assert {a.name for a in measured} >= {"num_experts", "checkpoint_weight_bytes_per_gpu"}
    assert len({a.name for a in p.assumptions}) == len(p.assumptions)


def test_plan_refuses_measurements_at_another_tp(tiny):
    model = with_checkpoint(MODELS["kimi-k3.1-pro"], check_checkpoint(tiny, tensor_parallel_size=4))
    with pytest.raises(ValueError, match="measured at TP=4"):
        plan(model, HARDWARE["mi355x"], tensor_parallel_size=8)


def test_plan_refuses_a_broken_checkpoint(tiny):
    (tiny / INDEX_FILE).unlink()
    with pytest.raises(ValueError, match="check-checkpoint"):
        with_checkpoint(MODELS["kimi-k3.1-pro"], check_checkpoint(tiny))


# ---- the command line --------------------------------------------------------------------------


def test_cli_ok_json_and_exit_codes(tiny, tmp_path):
    ok = run_cli("check-checkpoint", str(tiny), "--json", "--tp", "8")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["bytes_per_rank"] == pytest.approx(169_672)
    (tiny / "model-00002-of-00003.safetensors").unlink()
    broken = run_cli("check-checkpoint", str(tiny))
    assert broken.returncode == 1 and "missing_shard" in broken.stdout
    assert "result: 1 problem(s)" in broken.stdout
    missing = run_cli("check-checkpoint", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    assert run_cli("check-checkpoint").returncode == 2


def test_cli_plan_with_checkpoint(tiny):
    # The tiny model's MLA latent does not fit K3's DSpark draft: plan it without one.
    out = run_cli("plan", "--checkpoint", str(tiny), "--json", "--draft", "none")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["weight_bytes_per_gpu"] == pytest.approx(169_672)
    assert result["brief_comparison"]["brief_bytes_per_gpu"] == 199e9
    (tiny / INDEX_FILE).unlink()
    broken = run_cli("plan", "--checkpoint", str(tiny))
    assert broken.returncode == 1 and "missing_index" in broken.stderr


def test_cli_help_describes_the_options():
    out = run_cli("check-checkpoint", "--help")
    assert out.returncode == 0
    for text in ("PATH", "--tp", "--json", "Exit status: 0", "1 problems found", "2 usage error"):
        assert text in out.stdout
    assert "--checkpoint" in run_cli("plan", "--help").stdout


def test_module_examples_run():
    assert doctest.testmod(moonserve.pipeline.capacity.checkpoint).failed == 0
    assert doctest.testmod(moonserve.pipeline.capacity.kimi_k3_layout).failed == 0
    assert doctest.testmod(moonserve.pipeline.models.weights).failed == 0
    assert doctest.testmod(moonserve.kernels.mxfp4.format).failed == 0  # the MXFP4 pair rule


def test_a_dspark_draft_is_reported_as_vllm_runs_it(tmp_path):
    """`check-checkpoint` on a draft says which drafter vLLM makes of it (the production config's
    TRITON_MLA draft backend holds only for K3's; tests/unit/test_production_config.py asks
    vLLM's SpeculativeConfig the same of both drafts)."""
    from moonserve.pipeline.synthetic_checkpoints.k3 import (
        write_dspark_config,
        write_qwen3_dspark_config,
    )

    for draft, kind in ((write_dspark_config(tmp_path / "k3"), "K3DSparkModel: K3's MLA drafter"),
                        (write_qwen3_dspark_config(tmp_path / "qwen3"),
                         "Qwen3DSparkModel: dense, non-MLA")):
        save_file({"layers.0.weight": bf16(4, 4)}, str(draft / "model.safetensors"))
        report = check_checkpoint(draft)
        assert report.ok, report.problems
        assert any(n.startswith(f"a DSpark draft; vLLM runs it as {kind}") for n in report.notes), \
            report.notes
