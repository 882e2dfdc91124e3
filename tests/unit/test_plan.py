"""Capacity planner: hand-checked arithmetic on a tiny spec, the brief's numbers on the real one."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import json
from pathlib import Path

import pytest

import moonserve.pipeline.capacity.plan
import moonserve.pipeline.capacity.registry
import moonserve.pipeline.capacity.report
from moonserve.pipeline.capacity.plan import (
    SOURCE_PREFIXES,
    Assumption,
    HardwareSpec,
    ModelSpec,
    ParamGroup,
    expected_distinct_experts,
    plan,
    scalar_field_names,
)
from moonserve.pipeline.capacity.registry import HARDWARE, MODELS, check_against_brief
from moonserve.pipeline.capacity.report import format_plan, plan_to_dict

K3 = MODELS["kimi-k3.1-pro"]
MI355X = HARDWARE["mi355x"]

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
    index_topk=4,
    indexer_key_bytes_per_layer=3,
    kda_num_heads=2,
    kda_head_dim=2,
    kda_conv_kernel_size=3,
    kda_recurrent_state_bytes_per_element=4.0,
    kda_conv_state_bytes_per_element=2.0,
    max_context_len=100,
    runtime_reserve_bytes_per_gpu=750.0,
    assumptions=(Assumption("runtime_reserve_bytes_per_gpu", 750.0, "bytes", TINY_NOTE),),
)
TINY_HW = HardwareSpec("tiny-gpu", gpus_per_node=2, hbm_bytes_per_gpu=10_000.0,
                       hbm_bandwidth_bytes_per_s=1000.0, assumptions=())


def tiny_plan(dcp: int = 1):
    return plan(TINY, TINY_HW, tensor_parallel_size=2, decode_context_parallel_size=dcp,
                contexts=(10, 50, 100), roofline_context_len=10, roofline_batch_sizes=(1, 2))


# ---- hand-computed arithmetic on the tiny spec -------------------------------------------------


def test_tiny_params_and_weights():
    p = tiny_plan()
    # LM params exclude vision: 6400 + 1000 + 500 + 250 + 100 = 8250.
    assert p.total_params == 8250
    # Activated: non-expert 1850 + 6400 * 2/8 = 3450.
    assert p.activated_params == pytest.approx(3450)
    # Bytes: 3400 + 1000 + 1000 + 500 + 200 + 100 = 6200.
    assert p.weight_bytes_total == pytest.approx(6200)
    # Per GPU at TP=2: sharded (3400 + 1000 + 1000 + 500) / 2 = 2950, replicated 200 + 100.
    assert p.weight_bytes_per_gpu == pytest.approx(3250)
    assert {w.name: w.bytes_per_gpu for w in p.weights}["router"] == pytest.approx(200)


def test_tiny_memory_budget():
    p = tiny_plan()
    assert p.used_bytes_per_gpu_at_start == pytest.approx(3250 + 750)
    # 0.9 * 10,000 - 4000 = 5000.
    assert p.kv_pool_bytes_per_gpu == pytest.approx(5000)


def test_tiny_kv_and_state():
    p = tiny_plan()
    # 2 MLA layers * ((4 latent + 2 rope) * 1 B + 3 B indexer key) = 18 B/token.
    assert p.kv_bytes_per_token == pytest.approx(18)
    assert p.kv_bytes_per_token_per_gpu == pytest.approx(18)
    # 1 KDA layer: recurrent 2 heads * 2 * 2 * 4 B = 32; conv 3 * 2 * 2 channels * (3 - 1) * 2 B
    # = 48; 80 B per sequence, split over 2 TP ranks by head.
    assert p.state_bytes_per_sequence == pytest.approx(80)
    assert p.state_bytes_per_sequence_per_gpu == pytest.approx(40)


def test_tiny_concurrency():
    # Per request per GPU = context * 18 + 40 at DCP=1; pool 5000.
    # 10: 220 -> 22; 50: 940 -> 5; 100: 1840 -> 2.
    assert [r.max_concurrent_requests for r in tiny_plan().concurrency] == [22, 5, 2]
    # DCP=2: context * 9 + 40. 10: 130 -> 38; 50: 490 -> 10; 100: 940 -> 5.
    assert [r.max_concurrent_requests for r in tiny_plan(dcp=2).concurrency] == [38, 10, 5]


def test_tiny_max_context_request_per_dcp():
    rows = tiny_plan().max_context_requests
    assert [r.decode_context_parallel_size for r in rows] == [1, 2]
    # 100 tokens: DCP=1 1800 + 40 = 1840 per GPU, 3680 over 2 GPUs; DCP=2 900 + 40 = 940.
    assert [r.bytes_per_gpu for r in rows] == pytest.approx([1840, 940])
    assert [r.bytes_per_node for r in rows] == pytest.approx([3680, 1880])
    assert all(r.fits_on_one_node for r in rows)


def test_tiny_roofline_batch_1():
    r = tiny_plan().roofline[0]
    # Weights read per GPU: experts 1700 * 2/8 = 425; attention 500 + lm_head 500; router 200;
    # embedding rows and vision not read. 1625.
    assert r.expected_distinct_experts == pytest.approx(2)
    assert r.weight_bytes_per_gpu == pytest.approx(1625)
    # KV: 2 layers * (min(10, 4) * 6 B selected + 10 * 3 B indexer scan) = 108; KDA state read +
    # write 2 * 40 = 80. 188.
    assert r.kv_state_bytes_per_gpu == pytest.approx(188)
    # 1813 B / 1000 B/s per GPU = 1.813 s per step, 1 token.
    assert r.step_time_s == pytest.approx(1.813)
    assert r.tokens_per_s == pytest.approx(1 / 1.813)
    assert r.step_bytes_per_node == pytest.approx(3626)
    assert r.aggregate_bandwidth_bytes_per_s == pytest.approx(2000)


def test_tiny_roofline_batch_2():
    r = tiny_plan().roofline[1]
    # Distinct experts 8 * (1 - (6/8)^2) = 3.5; experts read 1700 * 3.5/8 = 743.75.
    assert r.expected_distinct_experts == pytest.approx(3.5)
    assert r.weight_bytes_per_gpu == pytest.approx(743.75 + 1200)
    assert r.kv_state_bytes_per_gpu == pytest.approx(2 * 188)
    assert r.tokens_per_s == pytest.approx(2 / 2.31975)


def test_expected_distinct_experts_limits():
    assert expected_distinct_experts(896, 16, 1) == pytest.approx(16)
    assert expected_distinct_experts(896, 16, 64) == pytest.approx(613.2, abs=0.05)
    assert expected_distinct_experts(896, 16, 100_000) == pytest.approx(896)


@pytest.mark.parametrize("kwargs, names", [
    ({"tensor_parallel_size": 4}, "tensor_parallel_size=4"),
    ({"decode_context_parallel_size": 3}, "decode_context_parallel_size=3"),
    ({"contexts": (101,)}, "context 101"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
])
def test_bad_layouts_name_the_input(kwargs, names):
    args = {"tensor_parallel_size": 2, "contexts": (10,), "roofline_context_len": 10} | kwargs
    with pytest.raises(ValueError, match=names):
        plan(TINY, TINY_HW, **args)


# ---- the brief, on the real registry entries -----------------------------------------------------


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_k3_reproduces_the_brief(dcp):
    assert check_against_brief(plan(K3, MI355X, decode_context_parallel_size=dcp)) == []


def test_k3_brief_numbers_explicitly():
    p = plan(K3, MI355X)
    assert p.total_params == pytest.approx(2.8e12, rel=1e-12)
    assert p.activated_params == pytest.approx(104e9, rel=1e-9)
    assert p.used_bytes_per_gpu_at_start == pytest.approx(199e9, rel=0.05)
    one_m = next(r for r in p.max_context_requests if r.decode_context_parallel_size == 1)
    assert one_m.context_len == 1_048_576 and one_m.fits_on_one_node


def test_k3_cache_sizes_by_hand():
    p = plan(K3, MI355X)
    # 24 MLA layers * ((512 + 64) * 1 B + 132 B indexer key) = 16,992 B/token.
    assert p.kv_bytes_per_token == 16_992
    # 69 KDA layers * (64 * 128 * 128 * 4 B + 3 * 64 * 128 * (4 - 1) * 2 B) = 299,581,440 B.
    assert p.state_bytes_per_sequence == 299_581_440
    assert p.state_bytes_per_sequence_per_gpu == 299_581_440 / 8


def test_check_against_brief_reports_violations():
    # 50 GB reserve: 242 GB used at start, pool 0.9 * 288 - 242 = 17.2 GB < 17.85 GB for 1M tokens.
    heavy = dataclasses.replace(K3, runtime_reserve_bytes_per_gpu=50e9)
    used, long_request = check_against_brief(plan(heavy, MI355X))
    assert "used bytes per GPU at start" in used and "199" in used
    assert "1,048,576-token request needs 17.85 GB" in long_request
    tiny = check_against_brief(tiny_plan())
    assert any("1,048,576-token request" in v for v in tiny)


@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_dcp_divides_per_token_kv_only(dcp):
    base, split = plan(K3, MI355X), plan(K3, MI355X, decode_context_parallel_size=dcp)
    assert split.kv_bytes_per_token_per_gpu == pytest.approx(base.kv_bytes_per_token_per_gpu / dcp)
    assert split.kv_bytes_per_token == base.kv_bytes_per_token
    # Not sharded by DCP: weights, runtime reserve, KDA state.
    assert split.weight_bytes_per_gpu == base.weight_bytes_per_gpu
    assert split.used_bytes_per_gpu_at_start == base.used_bytes_per_gpu_at_start
    assert split.state_bytes_per_sequence_per_gpu == base.state_bytes_per_sequence_per_gpu
    rows = {r.decode_context_parallel_size: r for r in base.max_context_requests}
    assert rows[dcp].kv_bytes_per_gpu == pytest.approx(rows[1].kv_bytes_per_gpu / dcp)
    assert rows[dcp].state_bytes_per_gpu == rows[1].state_bytes_per_gpu


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_concurrency_does_not_grow_with_context(dcp):
    p = plan(K3, MI355X, decode_context_parallel_size=dcp)
    counts = [r.max_concurrent_requests for r in p.concurrency]
    assert [r.context_len for r in p.concurrency] == [8192, 131072, 1048576]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1


def test_dcp_admits_more_long_requests():
    base, split = plan(K3, MI355X), plan(K3, MI355X, decode_context_parallel_size=8)
    for a, b in zip(base.concurrency, split.concurrency):
        assert b.max_concurrent_requests > a.max_concurrent_requests


def test_k3_roofline_batching_raises_throughput_not_per_sequence_speed():
    b1, b64 = plan(K3, MI355X).roofline
    assert (b1.batch_size, b64.batch_size) == (1, 64)
    assert b64.tokens_per_s > b1.tokens_per_s
    assert b64.tokens_per_s / 64 < b1.tokens_per_s
    assert b1.aggregate_bandwidth_bytes_per_s == pytest.approx(64e12)


# ---- output and provenance -----------------------------------------------------------------------


def test_plan_dict_round_trips_through_json():
    d = plan_to_dict(plan(K3, MI355X, decode_context_parallel_size=8))
    assert json.loads(json.dumps(d)) == d
    assert d["kv_bytes_per_token"] == 16_992


def test_every_assumption_has_a_source():
    for a in plan(K3, MI355X).assumptions:
        assert a.source.strip(), a.name
        assert a.source.startswith(SOURCE_PREFIXES), a
        if a.source.startswith("assumption:"):
            assert "because" in a.source, a


def test_assumption_names_are_unique():
    names = [a.name for a in plan(K3, MI355X).assumptions]
    assert len(names) == len(set(names))


def test_k3_spec_values_come_from_their_assumptions():
    recorded = {a.name: a.value for a in K3.assumptions}
    for name in scalar_field_names():
        assert getattr(K3, name) == recorded[name], name
    for g in K3.param_groups:
        assert g.num_params == recorded[f"{g.name}_params"], g.name
    hw = {a.name: a.value for a in MI355X.assumptions}
    assert (MI355X.gpus_per_node, MI355X.hbm_bytes_per_gpu, MI355X.hbm_bandwidth_bytes_per_s) == (
        hw["gpus_per_node"], hw["hbm_bytes_per_gpu"], hw["hbm_bandwidth_bytes_per_s"])


def test_nominal_weight_inputs_name_k3_assumptions():
    recorded = {a.name for a in K3.assumptions}
    assert set(K3.nominal_weight_inputs) <= recorded
    assert {"hidden_size", "routed_experts_params", "total_params"} <= set(K3.nominal_weight_inputs)


def test_generic_planner_imports_no_registry_or_report():
    # plan.py is model-agnostic: Kimi K3 facts reach it only as ModelSpec data.
    tree = ast.parse(Path(moonserve.pipeline.capacity.plan.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"moonserve.pipeline.capacity.registry",
                           "moonserve.pipeline.capacity.report"}


def test_format_plan_lists_every_assumption_with_its_source():
    p = plan(K3, MI355X)
    text = format_plan(p)
    for a in p.assumptions:
        assert a.name in text and a.source in text
    assert "198.97" in text and "16,992" in text


@pytest.mark.parametrize("module", [moonserve.pipeline.capacity.plan,
                                    moonserve.pipeline.capacity.registry,
                                    moonserve.pipeline.capacity.report])
def test_module_docstring_example_runs(module):
    assert doctest.testmod(module).failed == 0


def test_plan_takes_parallelism_from_a_config_file():
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "-m", "moonserve.pipeline.app.cli", "plan", "--json", "--config",
                          str(REPO / "configs" / "mi355x-k3.1-pro.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["tensor_parallel_size"], plan["decode_context_parallel_size"]) == (8, 8)
    assert "engine settings from" in out.stderr and plan["brief_violations"] == []
