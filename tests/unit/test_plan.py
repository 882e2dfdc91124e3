"""Capacity planner: hand-checked arithmetic on a tiny spec, vLLM's own KV classes on the real one."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import json
import math
from pathlib import Path

import pytest
import yaml

import moonserve.pipeline.capacity.plan
import moonserve.pipeline.capacity.registry
import moonserve.pipeline.capacity.report
from moonserve.pipeline.capacity.plan import (
    SOURCE_PREFIXES,
    Assumption,
    EngineLimits,
    HardwareSpec,
    KVCacheSettings,
    ModelSpec,
    ParamGroup,
    draft_service_weight_bytes,
    expected_distinct_experts,
    hybrid_kv_layout,
    plan,
    scalar_field_names,
)
from moonserve.pipeline.capacity.registry import (
    BRIEF_USED_BYTES_PER_GPU_AT_START,
    DRAFTS,
    HARDWARE,
    MODELS,
    k3_kv_cache_settings,
)
from moonserve.pipeline.capacity.report import compare_with_brief, format_plan, plan_to_dict

K3 = MODELS["kimi-k3.1-pro"]
DSPARK = DRAFTS["kimi-k3-dspark"]
MI355X = HARDWARE["mi355x"]
K3_KV = k3_kv_cache_settings()  # 7 speculative tokens, prefix caching ("align"), 1 checkpoint page

TINY_NOTE = "test: tiny made-up spec"
TINY = ModelSpec(
    name="tiny",
    param_groups=(
        ParamGroup("experts", 6400, "mxfp4", "routed_expert", True),  # 6400 * 4.25/8 = 3400 B
        ParamGroup("attention", 1000, "fp8", "dense", True),  # 1000 B
        ParamGroup("lm_head", 500, "bf16", "dense", True),  # 1000 B
        ParamGroup("embed_tokens", 250, "bf16", "embedding_lookup", True),  # 500 B
        ParamGroup("router", 100, "bf16", "dense", False),  # 200 B on every rank
        ParamGroup("vision", 50, "bf16", "vision", False),  # 100 B on every rank
    ),
    num_experts=8,
    num_experts_per_token=2,
    num_kda_layers=1,
    num_mla_layers=2,
    kv_lora_rank=4,
    qk_rope_head_dim=2,
    kv_cache_bytes_per_element=1.0,
    kda_num_heads=2,
    kda_head_dim=2,
    kda_conv_kernel_size=3,
    kda_recurrent_state_bytes_per_element=4.0,
    kda_conv_state_bytes_per_element=2.0,
    max_context_len=1000,
    runtime_reserve=(Assumption("reserve", 750.0, "bytes", TINY_NOTE),),
    assumptions=(),
)
TINY_HW = HardwareSpec("tiny-gpu", gpus_per_node=2, hbm_bytes_per_gpu=100_000.0,
                       hbm_bandwidth_bytes_per_s=1000.0, assumptions=())


def tiny_plan(dcp: int = 1, **kwargs):
    return plan(TINY, TINY_HW, tensor_parallel_size=2, decode_context_parallel_size=dcp,
                contexts=(10, 200, 1000), roofline_context_len=10, roofline_batch_sizes=(1, 2),
                **kwargs)


def k3_plan(**kwargs):
    return plan(K3, MI355X, **{"draft": DSPARK, "kv_cache": K3_KV} | kwargs)


# ---- hand-computed arithmetic on the tiny spec -------------------------------------------------


def test_tiny_params_and_weights():
    p = tiny_plan()
    assert p.total_params == 8250  # vision excluded
    assert p.activated_params == pytest.approx(1850 + 6400 * 2 / 8)
    assert p.weight_bytes_total == pytest.approx(6200)
    # Sharded (3400 + 1000 + 1000 + 500) / 2 = 2950, replicated router 200 + vision 100.
    assert p.weight_bytes_per_gpu == pytest.approx(3250)


def test_tiny_memory_budget():
    p = tiny_plan()
    assert p.used_bytes_per_gpu_at_start == pytest.approx(3250 + 750)
    assert p.kv_pool_bytes_per_gpu == pytest.approx(0.9 * 100_000 - 4000)


def test_tiny_kv_layout_by_hand():
    k = tiny_plan().kv_layout
    # MLA page per token: 4 latent + 2 rope at 1 B = 6 B. KDA at TP=2: 1 head; conv 3 * 1 * 2
    # channels * (3 - 1) taps * 2 B = 24, recurrent 1 * 2 * 2 * 4 B = 16: 40 B.
    assert (k.mla_bytes_per_token_per_layer, k.kda_state_bytes_per_layer) == (6, 40)
    # Smallest multiple of 128 tokens holding 40 B: 128; page 768 B, KDA padded by 728 B.
    assert (k.block_size, k.page_bytes, k.kda_page_padding_bytes) == (128, 768, 728)
    # 2 MLA vs 1 KDA layers: 2 >= 1.5 * 1, so groups of 1 layer; 2 MLA groups + 1 KDA group.
    assert (k.group_size, k.num_mla_groups, k.num_kda_groups) == (1, 2, 1)
    assert k.bytes_per_block == 768 and k.kda_pages_per_sequence == 1


def test_tiny_concurrency_in_whole_blocks():
    # Pool 86,000 B // 768 = 111 blocks, minus the null block: 110. A request holds 2 MLA blocks
    # per 128 tokens (one per MLA group) + 1 KDA block.
    # 10: 2 + 1 = 3 -> 36; 200: 4 + 1 = 5 -> 22; 1000: 16 + 1 = 17 -> 6.
    assert [r.max_concurrent_requests for r in tiny_plan().concurrency] == [36, 22, 6]
    # DCP=2 halves the MLA blocks per rank: 1000 tokens -> 2 * ceil(1000 / 256) + 1 = 9 -> 12.
    assert tiny_plan(dcp=2).concurrency[-1].max_concurrent_requests == 12


def test_tiny_speculation_lengthens_conv_state_and_adds_state_pages():
    k = tiny_plan(kv_cache=KVCacheSettings(num_speculative_tokens=3)).kv_layout
    # Conv taps 3 - 1 + 3 = 5: 3 * 2 * 5 * 2 B = 60, + 16 recurrent.
    assert k.kda_state_bytes_per_layer == 76 and k.kda_pages_per_sequence == 4
    align = tiny_plan(kv_cache=KVCacheSettings(3, True, 1)).kv_layout
    assert align.kda_pages_per_sequence == 2 + 3 + 1


def test_tiny_roofline_reads_every_cached_token():
    r = tiny_plan().roofline[0]
    # Weights: experts 1700 * 2/8 = 425 + attention 500 + lm_head 500 + router 200 = 1625.
    assert r.weight_bytes_per_gpu == pytest.approx(1625)
    # Dense MLA (no indexer): 2 layers * 10 tokens * 6 B = 120; KDA state read + write 2 * 40.
    assert r.kv_state_bytes_per_gpu == pytest.approx(200)
    assert r.step_time_s == pytest.approx(1.825)


def test_expected_distinct_experts_limits():
    assert expected_distinct_experts(896, 16, 1) == pytest.approx(16)
    assert expected_distinct_experts(896, 16, 64) == pytest.approx(613.2, abs=0.05)
    assert expected_distinct_experts(896, 16, 100_000) == pytest.approx(896)


@pytest.mark.parametrize("kwargs, names", [
    ({"tensor_parallel_size": 4}, "tensor_parallel_size=4"),
    ({"decode_context_parallel_size": 3}, "decode_context_parallel_size=3"),
    ({"contexts": (1001,)}, "context 1001"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
])
def test_bad_layouts_name_the_input(kwargs, names):
    args = {"tensor_parallel_size": 2, "contexts": (10,), "roofline_context_len": 10} | kwargs
    with pytest.raises(ValueError, match=names):
        plan(TINY, TINY_HW, **args)


# ---- the real entries against vLLM's own KV cache classes ---------------------------------------


def test_k3_mla_page_per_token_is_vllms_mla_spec():
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    # What vLLM's K3 MLA get_kv_cache_spec returns for kv_cache_dtype fp8, one token per block.
    spec = MLAAttentionSpec(block_size=1, num_kv_heads=1, max_tp_shards=1,
                            head_size=K3.kv_lora_rank + K3.qk_rope_head_dim,
                            dtype=torch.float8_e4m3fn, cache_dtype_str="fp8",
                            kv_quant_mode=get_kv_quant_mode("fp8"))
    layout = hybrid_kv_layout(K3, 8, K3_KV, DSPARK)
    assert layout.mla_bytes_per_token_per_layer == spec.page_size_bytes == 576
    assert k3_plan().kv_bytes_per_token == (24 + 5) * spec.page_size_bytes


def test_k3_kda_state_is_vllms_mamba_spec():
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = MambaStateShapeCalculator.kda_state_shape(
        8, K3.kda_num_heads, K3.kda_head_dim, conv_kernel_size=K3.kda_conv_kernel_size, num_spec=7)
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    spec = MambaSpec(shapes=tuple(shapes), dtypes=dtypes, block_size=-1)
    assert hybrid_kv_layout(K3, 8, K3_KV, DSPARK).kda_state_bytes_per_layer == (
        spec.page_size_bytes)


def _vllm_specs(layout, num_mla: int, num_kda: int, pad_mamba: bool):
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, get_kv_quant_mode

    mla = MLAAttentionSpec(block_size=layout.block_size, num_kv_heads=1, max_tp_shards=1,
                           head_size=576, dtype=torch.float8_e4m3fn, cache_dtype_str="fp8",
                           kv_quant_mode=get_kv_quant_mode("fp8"))
    heads = K3.kda_num_heads // 8
    kda = MambaSpec(shapes=((3 * heads * 128, 3 + 7), (heads, 128, 128)),
                    dtypes=(torch.bfloat16, torch.float32), block_size=layout.block_size,
                    page_size_padded=layout.page_bytes if pad_mamba else None)
    return {**{f"mla.{i}": mla for i in range(num_mla)},
            **{f"kda.{i}": kda for i in range(num_kda)}}


def test_k3_page_padding_is_what_vllms_unification_pads():
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size

    layout = hybrid_kv_layout(K3, 8, K3_KV, DSPARK)
    unified = unify_kv_cache_spec_page_size(_vllm_specs(layout, 29, 69, pad_mamba=False))
    kda = unified["kda.0"]
    assert kda.page_size_bytes == layout.page_bytes
    assert kda.page_size_bytes - kda.real_page_size_bytes == layout.kda_page_padding_bytes > 0
    # The block is the smallest multiple of 128 tokens whose MLA page holds a KDA state page.
    assert layout.page_bytes - 128 * 576 < layout.kda_state_bytes_per_layer <= layout.page_bytes


def test_k3_groups_and_block_bytes_are_vllms():
    from vllm.v1.core.kv_cache_utils import (
        _get_kv_cache_bytes_per_block,
        _get_kv_cache_groups_uniform_page_size,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = hybrid_kv_layout(K3, 8, K3_KV, DSPARK)
    groups = _get_kv_cache_groups_uniform_page_size(_vllm_specs(layout, 29, 69, pad_mamba=True))
    sizes = sorted(len(g.layer_names) for g in groups)
    assert len(groups) == layout.num_mla_groups + layout.num_kda_groups
    assert max(sizes) == layout.group_size
    assert len(groups) * layout.group_size - (29 + 69) == layout.kda_padding_layers == 18
    assert _get_kv_cache_bytes_per_block(groups, KVCacheLayout.LBHNC) == layout.bytes_per_block


def test_no_indexer_cache_or_weights():
    # vLLM's K3 MLA builds indexer=None: a token costs latent + rope only, and decode reads every
    # cached token (no top-k); no indexer assumption is left in the registry.
    p = k3_plan(decode_context_parallel_size=1)
    assert p.kv_layout.mla_bytes_per_token_per_layer == 512 + 64
    assert not any("indexer" in a.name for a in p.assumptions)
    b1 = p.roofline[0]
    state = 69 * moonserve.pipeline.capacity.plan.kda_state_bytes_per_layer(K3, 8, 0)
    assert b1.kv_state_bytes_per_gpu == pytest.approx(24 * 8192 * 576 + 2 * state)


# ---- what the engine holds at start --------------------------------------------------------------


def test_draft_weights_are_counted():
    with_draft, without = k3_plan(), k3_plan(draft=None)
    draft_bytes = sum(w.bytes_per_gpu for w in with_draft.weights if w.role == "draft")
    assert draft_bytes > 1e9
    assert with_draft.used_bytes_per_gpu_at_start - without.used_bytes_per_gpu_at_start == (
        pytest.approx(draft_bytes))
    assert with_draft.kv_layout.num_mla_layers == without.kv_layout.num_mla_layers + 5


def test_draft_params_match_its_checkpoint_size():
    # lightseekorg/kimi-k3-dspark model.safetensors is 7.12 GB in bf16 and also holds the
    # vocab x hidden embedding vLLM drops (shared with the target).
    draft = sum(g.num_params for g in DSPARK.param_groups)
    assert (draft + 163840 * 7168) * 2 == pytest.approx(7.12e9, rel=0.01)


def test_vit_is_counted_on_every_gpu():
    vision = next(g for g in K3.param_groups if g.role == "vision")
    # MoonViT 27 x 1024 (the brief's 401M) + the patchmergerv2 projector to hidden_size 7168.
    assert vision.num_params == 447_358_976 and not vision.tp_sharded
    no_vit = dataclasses.replace(K3, param_groups=tuple(g for g in K3.param_groups
                                                        if g.role != "vision"))
    assert k3_plan().used_bytes_per_gpu_at_start - plan(
        no_vit, MI355X, draft=DSPARK, kv_cache=K3_KV).used_bytes_per_gpu_at_start == (
        pytest.approx(vision.num_bytes))


def test_runtime_reserve_is_separate_sourced_terms():
    p = k3_plan()
    assert len(p.runtime_reserve) >= 3
    assert p.runtime_reserve_bytes_per_gpu == sum(r.bytes_per_gpu for r in p.runtime_reserve)
    assert p.used_bytes_per_gpu_at_start == pytest.approx(
        p.weight_bytes_per_gpu + p.runtime_reserve_bytes_per_gpu)
    for term in p.runtime_reserve:
        assert term.source.startswith(("assumption:", "derived:", "vllm:", "measured:")), term


def test_speculation_multiplies_k3_state_per_request():
    spec, plain = k3_plan(), k3_plan(draft=None, kv_cache=k3_kv_cache_settings(0))
    # "align": 2 + 7 + 1 state pages in each of 3 KDA groups vs 2 + 0 + 1.
    assert spec.kv_layout.kda_pages_per_sequence == 10 and plain.kv_layout.kda_pages_per_sequence == 3
    assert spec.concurrency[0].max_concurrent_requests < plain.concurrency[0].max_concurrent_requests


def test_brief_is_printed_not_enforced():
    assert not hasattr(moonserve.pipeline.capacity.registry, "check_against_brief")
    p = k3_plan()
    b = compare_with_brief(p, BRIEF_USED_BYTES_PER_GPU_AT_START)
    assert b.brief_bytes_per_gpu == 199e9
    assert b.residual_bytes_per_gpu == pytest.approx(p.used_bytes_per_gpu_at_start - 199e9)
    heavy = dataclasses.replace(K3, runtime_reserve=K3.runtime_reserve + (
        Assumption("extra", 50e9, "bytes", "assumption: test because test"),))
    # (50 GB more leaves no room for one 1M-token request: planned at 128k.)
    moved = compare_with_brief(plan(heavy, MI355X, draft=DSPARK, kv_cache=K3_KV,
                                    limits=EngineLimits(max_model_len=131072)),
                               BRIEF_USED_BYTES_PER_GPU_AT_START)
    assert moved.residual_bytes_per_gpu == pytest.approx(b.residual_bytes_per_gpu + 50e9)


def test_report_prints_brief_derived_residual_and_sources():
    p = k3_plan()
    b = compare_with_brief(p, BRIEF_USED_BYTES_PER_GPU_AT_START)
    text = format_plan(p, b)
    derived = f"{p.used_bytes_per_gpu_at_start / 1e9:,.2f}"
    residual = f"{b.residual_bytes_per_gpu / 1e9:+,.2f}"
    for row in ("brief  ", "derived  ", "residual (derived - brief)"):
        assert row in text
    assert "199.00" in text and derived in text and residual in text
    for term in p.runtime_reserve:
        assert term.source in text
    for a in p.assumptions:
        assert a.name in text and a.source in text


# ---- DCP, concurrency, roofline on the real entries ----------------------------------------------


@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_dcp_divides_mla_blocks_only(dcp):
    base, split = k3_plan(), k3_plan(decode_context_parallel_size=dcp)
    assert split.kv_bytes_per_token_per_gpu == pytest.approx(base.kv_bytes_per_token_per_gpu / dcp)
    assert split.used_bytes_per_gpu_at_start == base.used_bytes_per_gpu_at_start
    rows = {r.decode_context_parallel_size: r for r in base.max_context_requests}
    block = base.kv_layout.bytes_per_block
    assert rows[dcp].kv_bytes_per_gpu == math.ceil(2**20 / (1536 * dcp)) * block
    assert rows[dcp].state_bytes_per_gpu == rows[1].state_bytes_per_gpu


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_concurrency_does_not_grow_with_context(dcp):
    counts = [r.max_concurrent_requests
              for r in k3_plan(decode_context_parallel_size=dcp).concurrency]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1


def test_k3_roofline_batching_raises_throughput_not_per_sequence_speed():
    b1, b64 = k3_plan().roofline
    assert b64.tokens_per_s > b1.tokens_per_s and b64.tokens_per_s / 64 < b1.tokens_per_s
    assert b1.aggregate_bandwidth_bytes_per_s == pytest.approx(64e12)


# ---- output and provenance -----------------------------------------------------------------------


def test_plan_dict_round_trips_through_json():
    d = plan_to_dict(k3_plan(decode_context_parallel_size=8))
    assert json.loads(json.dumps(d)) == d
    assert d["kv_layout"]["block_size"] == 1536


def test_every_assumption_has_a_source():
    for a in k3_plan().assumptions:
        assert a.source.startswith(SOURCE_PREFIXES), a
        if a.source.startswith("assumption:"):
            assert "because" in a.source, a


def test_assumption_names_are_unique():
    names = [a.name for a in k3_plan().assumptions]
    assert len(names) == len(set(names))


def test_k3_spec_values_come_from_their_assumptions():
    recorded = {a.name: a.value for a in K3.assumptions}
    for name in scalar_field_names():
        assert getattr(K3, name) == recorded[name], name
    for g in K3.param_groups:
        key = "vision_encoder_params" if g.role == "vision" else f"{g.name}_params"
        assert g.num_params == recorded[key], g.name
    drafted = {a.name: a.value for a in DSPARK.assumptions}
    assert all(g.num_params == drafted[f"{g.name}_params"] for g in DSPARK.param_groups)


def test_generic_planner_imports_no_registry_or_report():
    tree = ast.parse(Path(moonserve.pipeline.capacity.plan.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"moonserve.pipeline.capacity.registry",
                           "moonserve.pipeline.capacity.report"}


@pytest.mark.parametrize("module", [moonserve.pipeline.capacity.plan,
                                    moonserve.pipeline.capacity.registry,
                                    moonserve.pipeline.capacity.report])
def test_module_docstring_example_runs(module):
    assert doctest.testmod(module).failed == 0


def test_plan_takes_settings_from_a_config_file():
    from moonserve.pipeline.config import load_app_config
    from tests.conftest import REPO, run_cli

    engine = load_app_config(REPO / "configs" / "mi355x-k3.1-pro.yaml").language_model.engine
    out = run_cli("plan", "--json", "--config", str(REPO / "configs" / "mi355x-k3.1-pro.yaml"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["tensor_parallel_size"], result["decode_context_parallel_size"]) == (
        engine.tensor_parallel_size, engine.decode_context_parallel_size)
    assert result["mamba_cache_mode"] == ("align" if engine.enable_prefix_caching else "none")
    assert "engine settings from" in out.stderr
    brief = result["brief_comparison"]
    assert brief["brief_bytes_per_gpu"] == 199e9
    assert brief["residual_bytes_per_gpu"] == pytest.approx(
        result["used_bytes_per_gpu_at_start"] - 199e9)


def test_planner_defaults_follow_the_production_config():
    """The reserve is sized by the production engine's batch and the draft's k: they must move
    together when the config changes."""
    from moonserve.pipeline.capacity.registry import (
        K3_DRAFT_ATTENTION_BACKEND,
        K3_ENCODER_GPU_MEMORY_UTILIZATION,
        K3_MAX_NUM_BATCHED_TOKENS,
        K3_MAX_NUM_SEQS,
        K3_RECIPE_NUM_SPECULATIVE_TOKENS,
    )
    from moonserve.pipeline.config import load_app_config
    from tests.conftest import REPO

    app = load_app_config(REPO / "configs" / "mi355x-k3.1-pro.yaml")
    assert K3_MAX_NUM_BATCHED_TOKENS == app.language_model.engine.max_num_batched_tokens
    assert K3_RECIPE_NUM_SPECULATIVE_TOKENS == app.draft.num_speculative_tokens
    assert K3_MAX_NUM_SEQS == app.language_model.engine.max_num_seqs
    assert K3_DRAFT_ATTENTION_BACKEND == app.draft.attention_backend
    assert K3_ENCODER_GPU_MEMORY_UTILIZATION == app.vision.encoder.gpu_memory_utilization


# ---- memory vLLM holds outside gpu_memory_utilization; the start-time check ------------------


def test_triton_mla_splits_are_vllms(monkeypatch):
    """vLLM's own `_compute_num_kv_splits`, run here with triton's `next_power_of_2` (the CPU
    build's triton is a stub without it)."""
    from vllm.v1.attention.backends.mla import triton_mla

    from moonserve.pipeline.capacity.plan import triton_mla_num_kv_splits

    monkeypatch.setattr(triton_mla.triton, "next_power_of_2", lambda n: 1 << (n - 1).bit_length(),
                        raising=False)
    for max_model_len in (1, 511, 512, 1000, 8192, 131072, 1_048_576):
        for compute_units in (4, 132, 256, 304):
            assert triton_mla_num_kv_splits(max_model_len, compute_units) == \
                triton_mla._compute_num_kv_splits(max_model_len, compute_units)


def test_the_triton_mla_workspace_is_the_shape_vllm_reserves():
    """The reservation in vLLM's source: [max_num_seqs * reorder_batch_threshold, heads x DCP,
    splits at max_model_len, kv_lora_rank + 1] float32; at the production settings, 8.6 GB per
    GPU on MI355X (128 seqs x 8 query tokens, 64 draft heads / TP 8, 512 splits, 513 x 4 B)."""
    import inspect

    from vllm.v1.attention.backends.mla import triton_mla

    source = inspect.getsource(triton_mla.TritonMLAMetadataBuilder._reserve_attn_logits_workspace)
    for term in ("scheduler_config.max_num_seqs", "* self.reorder_batch_threshold",
                 "self.num_heads * self.dcp_world_size", "self.model_config.max_model_len",
                 "kv_lora_rank + 1", "((B, q_num_heads, max_splits, lse_dim), torch.float32)"):
        assert term in source
    p = k3_plan(limits=EngineLimits(draft_attention_backend="TRITON_MLA"))
    workspace = {t.name: t.bytes_per_gpu for t in p.outside_pool}
    assert workspace == {"triton_mla_workspace (every GPU)": 128 * 8 * 8 * 512 * 513 * 4}
    assert workspace["triton_mla_workspace (every GPU)"] == 8_606_711_808
    # Outside vLLM's share: the KV pool is the same, the GPU has that much less left.
    plain = k3_plan()
    assert p.kv_pool_bytes_per_gpu == plain.kv_pool_bytes_per_gpu
    assert p.hbm_left_bytes_per_gpu == pytest.approx(plain.hbm_left_bytes_per_gpu - 8_606_711_808)


def test_a_gpu_that_cannot_hold_the_share_the_workspace_and_the_encoder_is_refused():
    limits = EngineLimits(draft_attention_backend="TRITON_MLA", encoder_gpu_memory_utilization=0.04)
    assert k3_plan(limits=limits, gpu_memory_utilization=0.9).hbm_left_bytes_per_gpu > 0
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.95 leaves 14.40 GB of a GPU, "
                                         r"and more is held beside it \(triton_mla_workspace"):
        k3_plan(limits=limits, gpu_memory_utilization=0.95)


def test_a_draft_service_on_part_of_a_gpu_is_held_beside_the_engine_and_must_hold_its_weights():
    """The DraftService on `draft.num_gpus` of one GPU: that share of HBM is its allocator's cap,
    outside vLLM's share; it loads the whole draft and its own embedding and LM head."""
    weights = draft_service_weight_bytes(K3, DSPARK)
    by_name = {g.name: g for g in K3.param_groups}
    assert weights == 2 * (sum(g.num_params for g in DSPARK.param_groups)
                           + by_name["embed_tokens"].num_params + by_name["lm_head"].num_params)
    assert 9.5e9 < weights < 9.6e9  # 2.41B draft + 2 x 1.17B, bf16
    plain = k3_plan(draft=None)
    shared = k3_plan(draft=None, limits=EngineLimits(draft_service_gpu_share=0.05,
                                                     draft_service_weight_bytes=weights))
    [term] = shared.outside_pool
    assert term.name == "draft_service (one GPU)"
    assert term.bytes_per_gpu == pytest.approx(0.05 * MI355X.hbm_bytes_per_gpu)
    assert shared.kv_pool_bytes_per_gpu == plain.kv_pool_bytes_per_gpu
    assert shared.hbm_left_bytes_per_gpu == pytest.approx(plain.hbm_left_bytes_per_gpu
                                                          - term.bytes_per_gpu)
    with pytest.raises(ValueError, match=r"draft.num_gpus=0.03: the DraftService may hold 8.64 GB "
                                         r"of a mi355x GPU, less than the 9.51 GB of weights"):
        k3_plan(draft=None, limits=EngineLimits(draft_service_gpu_share=0.03,
                                                draft_service_weight_bytes=weights))


def test_one_max_model_len_request_that_does_not_fit_is_refused_as_vllm_refuses_it():
    """vLLM's start-time check (v1/core/kv_cache_utils.py `_check_enough_kv_cache_memory`)."""
    import inspect

    from vllm.v1.core import kv_cache_utils

    wording = "To serve at least one request with the model's max seq len"
    assert wording in inspect.getsource(kv_cache_utils._check_enough_kv_cache_memory)
    with pytest.raises(ValueError, match=wording + r" \(1048576\), 18.\d\d GB KV cache is needed"):
        k3_plan(gpu_memory_utilization=0.74)
    shorter = k3_plan(gpu_memory_utilization=0.74, limits=EngineLimits(max_model_len=131072))
    assert shorter.max_model_len == 131072 and shorter.max_context_requests[0].fits_on_one_node


def test_plan_counts_what_the_production_config_puts_beside_the_engine():
    from moonserve.pipeline.config import load_app_config
    from tests.conftest import REPO, run_cli

    config = REPO / "configs" / "mi355x-k3.1-pro.yaml"
    app = load_app_config(config)
    out = run_cli("plan", "--json", "--config", str(config))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    outside = {t["name"]: t["bytes_per_gpu"] for t in result["outside_pool"]}
    assert outside["vision_encoder_engine (one GPU)"] == pytest.approx(
        app.vision.encoder.gpu_memory_utilization * MI355X.hbm_bytes_per_gpu)
    assert outside["triton_mla_workspace (every GPU)"] == 8_606_711_808
    assert result["max_model_len"] == app.language_model.engine.max_model_len
    assert 0 < result["hbm_left_bytes_per_gpu"] < 10e9
    assert "draft_service (one GPU)" not in outside  # inline: the draft is in the engine


def test_plan_counts_the_draft_service_the_production_config_offers(tmp_path):
    """The production config with `draft.mode: service` (its draft.num_gpus, a share of an LM
    GPU): no draft in the engine, the DraftService's share beside the encoder's; an n-gram
    DraftService loads no weights, so a smaller share passes."""
    from moonserve.pipeline.config import load_app_config
    from tests.conftest import REPO, run_cli

    data = yaml.safe_load((REPO / "configs" / "mi355x-k3.1-pro.yaml").read_text())
    draft = data["applications"][0]["args"]["draft"]
    draft["mode"] = "service"
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(data))
    share = load_app_config(config).draft.num_gpus
    assert 0 < share < 1
    result = json.loads(run_cli("plan", "--json", "--config", str(config)).stdout)
    outside = {t["name"]: t["bytes_per_gpu"] for t in result["outside_pool"]}
    assert result["draft_name"] is None and "triton_mla_workspace (every GPU)" not in outside
    assert outside["draft_service (one GPU)"] == pytest.approx(share * MI355X.hbm_bytes_per_gpu)
    assert result["hbm_left_bytes_per_gpu"] > 0
    draft |= {"num_gpus": 0.01}
    config.write_text(yaml.safe_dump(data))
    refused = run_cli("plan", "--config", str(config))
    assert refused.returncode == 2 and "draft.num_gpus=0.01" in refused.stderr
    draft |= {"drafter": "ngram", "model": "embedded"}
    config.write_text(yaml.safe_dump(data))
    assert run_cli("plan", "--config", str(config)).returncode == 0
