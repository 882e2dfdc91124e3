"""The models and hardware `moonserve plan` knows, and the brief's figures a plan must reproduce.

`MODELS["kimi-k3.1-pro"]` is Kimi K3.1 Pro as the product brief describes it (2.8T total / 104B
activated parameters, 69 KDA + 24 MLA layers, 16 of 896 experts active, MXFP4 routed experts, FP8
attention and dense layers, FP8 KV cache, 1M-token context). Every number the brief does not give
is an `Assumption` saying why it was chosen; the parameter groups are derived from them.
`HARDWARE["mi355x"]` is one node of 8 AMD MI355X. `check_against_brief` lists where a plan misses
the brief's figures by more than 5%.

Example:
    >>> from moonserve.pipeline.capacity.plan import plan
    >>> check_against_brief(plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"]))
    []
"""

from __future__ import annotations

from moonserve.pipeline.capacity.plan import (
    DTYPE_BYTES,
    GB,
    Assumption,
    HardwareSpec,
    ModelSpec,
    ParamGroup,
    Plan,
    Role,
    scalar_field_names,
)

BRIEF_TOTAL_PARAMS = 2.8e12
BRIEF_ACTIVATED_PARAMS = 104e9
BRIEF_USED_BYTES_PER_GPU_AT_START = 199 * GB
BRIEF_LONG_REQUEST_LEN = 1_048_576
BRIEF_TOLERANCE = 0.05


def check_against_brief(p: Plan) -> list[str]:
    """Violations of the product brief's numbers (±5%); empty when the plan reproduces them."""
    violations = [
        _off_by_more_than_tolerance("total params", p.total_params, BRIEF_TOTAL_PARAMS),
        _off_by_more_than_tolerance("activated params", p.activated_params, BRIEF_ACTIVATED_PARAMS),
        _off_by_more_than_tolerance("used bytes per GPU at start", p.used_bytes_per_gpu_at_start,
                                    BRIEF_USED_BYTES_PER_GPU_AT_START),
        _long_request_violation(p),
    ]
    return [v for v in violations if v]


def _off_by_more_than_tolerance(what: str, value: float, target: float) -> str:
    if abs(value / target - 1) <= BRIEF_TOLERANCE:
        return ""
    return (f"{what}: {value / GB:,.2f}e9 is not within ±{BRIEF_TOLERANCE:.0%} of the brief's "
            f"{target / GB:,.2f}e9")


def _long_request_violation(p: Plan) -> str:
    # The brief claims the fit without DCP: "~199 GB/GPU used at start, so one 1M request fits".
    rows = [r for r in p.max_context_requests
            if r.context_len == BRIEF_LONG_REQUEST_LEN and r.decode_context_parallel_size == 1]
    if not rows:
        return f"no {BRIEF_LONG_REQUEST_LEN:,}-token request in the plan (max_context_len differs)"
    if rows[0].fits_on_one_node:
        return ""
    return (f"one {BRIEF_LONG_REQUEST_LEN:,}-token request needs {rows[0].bytes_per_gpu / GB:.2f} "
            f"GB per GPU without DCP; the KV/state pool is {p.kv_pool_bytes_per_gpu / GB:.2f} GB")


def _kimi_k3_geometry() -> tuple[Assumption, ...]:
    """Numbers the brief does not give; they shape parameter counts and cache sizes."""
    k2_mla = ("assumption: Kimi K2 / DeepSeek-V3 MLA geometry, because the brief gives only "
              "latent 512 + rope 64")
    v32_indexer = ("assumption: DeepSeek-V3.2 sparse indexer geometry (same 2,048-token top-k), "
                   "because the brief gives no indexer geometry")
    return (
        Assumption("hidden_size", 7168, "elements",
                   "assumption: Kimi K2's hidden size, because K3 keeps K2's MLA latent geometry "
                   "(512 + 64, from the brief) and the brief gives no hidden size"),
        Assumption("vocab_size", 163840, "tokens",
                   "assumption: the Kimi tokenizer's vocabulary (Kimi K2; vLLM KimiLinearConfig "
                   "default; K3's media placeholder id 163605 lies inside it), because the brief "
                   "gives none"),
        Assumption("num_dense_layers", 1, "layers",
                   "assumption: first layer has a dense MLP, the other 92 are MoE (K2's "
                   "first_k_dense_replace=1), because the brief gives none"),
        Assumption("mla_num_heads", 64, "heads", k2_mla),
        Assumption("q_lora_rank", 1536, "elements", k2_mla),
        Assumption("qk_nope_head_dim", 128, "elements", k2_mla),
        Assumption("v_head_dim", 128, "elements", k2_mla),
        Assumption("indexer_num_heads", 64, "heads", v32_indexer),
        Assumption("indexer_head_dim", 128, "elements", v32_indexer),
    )


def _kimi_k3_cache_facts() -> tuple[Assumption, ...]:
    return (
        Assumption("num_kda_layers", 69, "layers", "brief"),
        Assumption("num_mla_layers", 24, "layers", "brief"),
        Assumption("kv_lora_rank", 512, "elements", "brief: MLA latent per token per layer"),
        Assumption("qk_rope_head_dim", 64, "elements", "brief: MLA rope key per token per layer"),
        Assumption("kv_cache_bytes_per_element", 1.0, "bytes", "brief: FP8 KV cache"),
        Assumption("index_topk", 2048, "tokens", "brief: history tokens selected per query"),
        Assumption("indexer_key_bytes_per_layer", 128 + 128 // 128 * 4, "bytes per token",
                   "assumption: 128 FP8 key values + one fp32 scale per 128 (vLLM's sparse-"
                   "indexer cache layout), because the brief gives no indexer key size"),
        Assumption("kda_num_heads", 64, "heads",
                   "assumption: 64 heads x 128 (the MLA head count at Kimi Linear's head_dim), "
                   "because the brief gives no KDA geometry"),
        Assumption("kda_head_dim", 128, "elements",
                   "assumption: Kimi Linear's KDA head_dim, because the brief gives none"),
        Assumption("kda_conv_kernel_size", 4, "taps",
                   "assumption: Kimi Linear's short_conv_kernel_size, because the brief gives "
                   "none"),
        Assumption("kda_recurrent_state_bytes_per_element", 4.0, "bytes",
                   "assumption: fp32 recurrent state (vLLM's KDA default with "
                   "mamba_ssm_cache_dtype=auto), because the brief gives no state dtype"),
        Assumption("kda_conv_state_bytes_per_element", 2.0, "bytes",
                   "assumption: conv state in bf16 (vLLM mamba_cache_dtype=auto follows the model "
                   "dtype), because the brief gives no state dtype"),
        Assumption("max_context_len", 1_048_576, "tokens", "brief: 1M-token context window"),
    )


def _kimi_k3_moe_and_dtypes() -> tuple[Assumption, ...]:
    return (
        Assumption("total_params", 2.8e12, "params", "brief"),
        Assumption("activated_params", 104e9, "params", "brief"),
        Assumption("num_experts", 896, "experts", "brief"),
        Assumption("num_experts_per_token", 16, "experts", "brief"),
        Assumption("mxfp4_bytes_per_param", DTYPE_BYTES["mxfp4"], "bytes",
                   "brief: MXFP4 routed experts, 4-bit E2M1 + one E8M0 scale byte per 32"),
        Assumption("fp8_bytes_per_param", DTYPE_BYTES["fp8"], "bytes",
                   "brief: FP8 re-quantized attention and dense layers"),
        Assumption("bf16_bytes_per_param", DTYPE_BYTES["bf16"], "bytes",
                   "brief: bf16 embeddings, LM head and vision encoder"),
        Assumption("vision_encoder_params", 401_000_000, "params", "brief: MoonViT-V2"),
        Assumption("runtime_reserve_bytes_per_gpu", 7 * GB, "bytes",
                   "assumption: ~4 GB activation + MoE workspace peak at 8,192 batched tokens, "
                   "~2 GB HIP graph pools, ~1 GB RCCL buffers and HIP context, because vLLM "
                   "measures it only at startup; with the weights above it reproduces the "
                   "brief's ~199 GB/GPU at start"),
    )


def _kimi_k3_param_counts(v: dict[str, float]) -> dict[str, int]:
    """Parameters per component; the routed experts are solved from the brief's two totals."""
    h, vocab = int(v["hidden_size"]), int(v["vocab_size"])
    num_moe_layers = int(v["num_mla_layers"] + v["num_kda_layers"] - v["num_dense_layers"])
    # N + R = total and N + R*k/E = activated  =>  R = (total - activated) * E / (E - k)
    experts, k = v["num_experts"], v["num_experts_per_token"]
    routed = round((v["total_params"] - v["activated_params"]) * experts / (experts - k))
    counts = {
        "routed_experts": routed,
        "embed_tokens": vocab * h,
        "lm_head": vocab * h,
        "moe_router": h * int(experts) * num_moe_layers,
        "attention_tp_sharded": _attention_sharded_params(v),
        "attention_replicated": int(v["num_mla_layers"]) * _mla_replicated_params_per_layer(v),
    }
    counts["dense_mlp"] = int(v["total_params"]) - sum(counts.values())
    return counts


def _mla_sharded_params_per_layer(v: dict[str, float]) -> int:
    heads, h = int(v["mla_num_heads"]), int(v["hidden_size"])
    q_b = int(v["q_lora_rank"]) * heads * int(v["qk_nope_head_dim"] + v["qk_rope_head_dim"])
    kv_b = int(v["kv_lora_rank"]) * heads * int(v["qk_nope_head_dim"] + v["v_head_dim"])
    o = heads * int(v["v_head_dim"]) * h
    return q_b + kv_b + o


def _mla_replicated_params_per_layer(v: dict[str, float]) -> int:
    # vLLM keeps q_a, kv_a and the indexer's wq_b / wk / weights_proj unsharded on every rank.
    h, q_lora = int(v["hidden_size"]), int(v["q_lora_rank"])
    q_a = h * q_lora
    kv_a = h * int(v["kv_lora_rank"] + v["qk_rope_head_dim"])
    indexer_dim = int(v["indexer_num_heads"] * v["indexer_head_dim"])
    indexer = q_lora * indexer_dim + h * int(v["indexer_head_dim"] + v["indexer_num_heads"])
    return q_a + kv_a + indexer


def _kda_params_per_layer(v: dict[str, float]) -> int:
    h, heads, dim = int(v["hidden_size"]), int(v["kda_num_heads"]), int(v["kda_head_dim"])
    proj = heads * dim
    in_proj = h * (4 * proj + dim + heads)  # q, k, v, output gate g, low-rank f_a, beta
    f_b = dim * proj
    conv = 3 * proj * int(v["kda_conv_kernel_size"])
    o = proj * h
    return in_proj + f_b + conv + o


def _attention_sharded_params(v: dict[str, float]) -> int:
    mla = int(v["num_mla_layers"]) * _mla_sharded_params_per_layer(v)
    return mla + int(v["num_kda_layers"]) * _kda_params_per_layer(v)


_K3_GROUP_LAYOUT: dict[str, tuple[str, Role, bool, str]] = {
    # name: (dtype, role, tp_sharded, source of its parameter count)
    "routed_experts": ("mxfp4", "routed_expert", True,
                       "brief: solved from 2.8T total and 104B activated with 16 of 896 experts "
                       "active, (total - activated) * 896 / 880"),
    "embed_tokens": ("bf16", "embedding_lookup", True, "derived: vocab_size * hidden_size"),
    "lm_head": ("bf16", "dense", True,
                "assumption: untied LM head (vocab_size * hidden_size) as in Kimi K2, because "
                "the brief gives none"),
    "moe_router": ("bf16", "dense", False,
                   "assumption: hidden_size * 896 gate per MoE layer, bf16 and replicated on every "
                   "TP rank (vLLM's GateLinear is neither sharded nor FP8), because the brief "
                   "gives no router dtype"),
    "attention_tp_sharded": ("fp8", "dense", True,
                             "derived: MLA q_b + kv_b + o and KDA in-proj (q, k, v, g, f_a, beta) "
                             "+ f_b + conv + o per layer from the assumed geometry"),
    "attention_replicated": ("fp8", "dense", False,
                             "derived: MLA q_a + kv_a + indexer wq_b, wk, weights_proj per layer, "
                             "which vLLM replicates on every TP rank"),
    "dense_mlp": ("fp8", "dense", True,
                  "assumption: the rest of the 2.8T after the groups above is shared experts + "
                  "the dense layer's MLP, because the brief fixes only the totals (moving params "
                  "between it and attention changes no bytes: both FP8, both TP-sharded)"),
}


def _kimi_k3_param_groups(
        v: dict[str, float]) -> tuple[tuple[ParamGroup, ...], tuple[Assumption, ...]]:
    counts = _kimi_k3_param_counts(v)
    groups = [ParamGroup(n, counts[n], dtype, role, sharded)
              for n, (dtype, role, sharded, _) in _K3_GROUP_LAYOUT.items()]
    # 12 ViT heads do not divide TP=8, so vLLM falls back to a data-parallel (replicated) ViT.
    groups.append(ParamGroup("vision_encoder", int(v["vision_encoder_params"]), "bf16", "vision",
                             False))
    records = [Assumption(f"{n}_params", counts[n], "params", layout[3])
               for n, layout in _K3_GROUP_LAYOUT.items()]
    return tuple(groups), tuple(records)


def _kimi_k3_1_pro() -> ModelSpec:
    assumptions = _kimi_k3_moe_and_dtypes() + _kimi_k3_cache_facts() + _kimi_k3_geometry()
    v = {a.name: a.value for a in assumptions}
    groups, group_records = _kimi_k3_param_groups(v)
    scalars = {name: v[name] for name in scalar_field_names()}
    return ModelSpec(name="kimi-k3.1-pro", param_groups=groups,
                     assumptions=assumptions + group_records,
                     nominal_weight_inputs=_nominal_weight_inputs(group_records), **scalars)


def _nominal_weight_inputs(group_records: tuple[Assumption, ...]) -> tuple[str, ...]:
    """Assumptions that only feed the nominal parameter counts; measured weights supersede them."""
    return (tuple(a.name for a in _kimi_k3_geometry()) + tuple(a.name for a in group_records)
            + ("total_params", "activated_params", "vision_encoder_params",
               "mxfp4_bytes_per_param", "fp8_bytes_per_param", "bf16_bytes_per_param"))


def _mi355x() -> HardwareSpec:
    return HardwareSpec(
        name="mi355x", gpus_per_node=8, hbm_bytes_per_gpu=288 * GB,
        hbm_bandwidth_bytes_per_s=8e12,
        assumptions=(
            Assumption("gpus_per_node", 8, "GPUs", "brief"),
            Assumption("hbm_bytes_per_gpu", 288 * GB, "bytes",
                       "brief: 288 GB HBM3E, read as 1e9-byte GB because the brief's ~199 GB is "
                       "read the same way (the stacks may hold 288 GiB = 309e9 bytes, so this "
                       "errs low)"),
            Assumption("hbm_bandwidth_bytes_per_s", 8e12, "bytes/s per GPU",
                       "vendor spec: AMD Instinct MI355X, 8 TB/s HBM3E peak"),
        ),
    )


MODELS: dict[str, ModelSpec] = {"kimi-k3.1-pro": _kimi_k3_1_pro()}
HARDWARE: dict[str, HardwareSpec] = {"mi355x": _mi355x()}
