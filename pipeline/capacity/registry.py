"""The models and hardware `moonserve plan` knows, and the brief's figure a plan is compared with.

`MODELS["kimi-k3.1-pro"]` is Kimi K3.1 Pro as the product brief describes it (2.8T total / 104B
activated parameters, 69 KDA + 24 MLA layers, 16 of 896 experts active, MXFP4 routed experts, FP8
attention and dense layers, FP8 KV cache, 1M-token context), with the in-engine ViT + projector
vLLM builds from `KimiK3VisionConfig`'s defaults. `DRAFTS["kimi-k3-dspark"]` is the DSpark draft of
the K3 serving recipes (lightseekorg/kimi-k3-dspark config.json). `HARDWARE["mi355x"]` is one node
of 8 AMD MI355X. Every number the brief does not give is an `Assumption` naming its source; none is
chosen to reproduce the brief. `BRIEF_USED_BYTES_PER_GPU_AT_START` is printed beside the derived
figure (`report.compare_with_brief`), not enforced.

Example:
    >>> from moonserve.pipeline.capacity.plan import plan
    >>> p = plan(MODELS["kimi-k3.1-pro"], HARDWARE["mi355x"], draft=DRAFTS["kimi-k3-dspark"])
    >>> [w.name for w in p.weights if w.role in ("vision", "draft")]
    ['vision_encoder', 'draft_tp_sharded', 'draft_replicated']
"""

from __future__ import annotations

import math

from moonserve.pipeline.capacity import kimi_k3_layout
from moonserve.pipeline.capacity.plan import (
    DTYPE_BYTES,
    GB,
    Assumption,
    DraftSpec,
    HardwareSpec,
    KVCacheSettings,
    ModelSpec,
    ParamGroup,
    Role,
    scalar_field_names,
)

BRIEF_USED_BYTES_PER_GPU_AT_START = Assumption(
    "brief_used_bytes_per_gpu_at_start", 199 * GB, "bytes",
    "brief: ~199 GB/GPU used at start (8x MI355X, TP=8), not itemized")

# Engine settings of configs/mi355x-k3.1-pro.yaml and the K3 recipes the planner sizes by default.
K3_RECIPE_NUM_SPECULATIVE_TOKENS = 7  # K3 DSpark recipes; lightseekorg/kimi-k3-dspark: "up to 7"
K3_MAX_NUM_BATCHED_TOKENS = 4096  # configs/mi355x-k3.1-pro.yaml engine.max_num_batched_tokens
K3_MAX_NUM_SEQS = 128  # engine.max_num_seqs
K3_DRAFT_ATTENTION_BACKEND = "TRITON_MLA"  # draft.attention_backend
K3_ENCODER_GPU_MEMORY_UTILIZATION = 0.04  # vision.encoder.gpu_memory_utilization


def k3_kv_cache_settings(num_speculative_tokens: int = K3_RECIPE_NUM_SPECULATIVE_TOKENS,
                         enable_prefix_caching: bool = True) -> KVCacheSettings:
    """K3 on MI355X: prefix caching as in the production config; one KDA prefill-checkpoint page
    in "align" mode (vllm/models/kimi_k3/amd/kda.py: kda_prefill_checkpoint defaults to True and
    gfx950 runs the fused chunk kernel; the K3 config is assumed to set a KDA gate lower bound)."""
    return KVCacheSettings(num_speculative_tokens, enable_prefix_caching,
                           1 if enable_prefix_caching else 0)


def _kimi_k3_geometry() -> tuple[Assumption, ...]:
    """Numbers the brief does not give; they shape parameter counts and cache sizes."""
    k2_mla = ("assumption: Kimi K2 / DeepSeek-V3 MLA geometry, because the brief gives only "
              "latent 512 + rope 64")
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
    )


def _kimi_k3_cache_facts() -> tuple[Assumption, ...]:
    return (
        Assumption("num_kda_layers", 69, "layers", "brief"),
        Assumption("num_mla_layers", 24, "layers", "brief"),
        Assumption("kv_lora_rank", 512, "elements", "brief: MLA latent per token per layer"),
        Assumption("qk_rope_head_dim", 64, "elements",
                   "brief: MLA rope key per token per layer (vLLM's K3 MLA is NoPE but its "
                   "MLAAttentionSpec head_size stays kv_lora_rank + qk_rope_head_dim)"),
        Assumption("kv_cache_bytes_per_element", 1.0, "bytes", "brief: FP8 KV cache"),
        Assumption("kda_num_heads", 96, "heads",
                   "assumption: NVIDIA Megatron-Bridge KimiK3TransformerConfig defaults "
                   "(kimi_linear_num_heads=96, head_dim 128), because the brief gives no KDA "
                   "geometry"),
        Assumption("kda_head_dim", 128, "elements",
                   "assumption: Kimi Linear's and Megatron-Bridge K3's KDA head_dim, because the "
                   "brief gives none"),
        Assumption("kda_conv_kernel_size", 4, "taps",
                   "assumption: Kimi Linear's short_conv_kernel_size, because the brief gives "
                   "none"),
        Assumption("kda_recurrent_state_bytes_per_element", 4.0, "bytes",
                   "vllm: model_executor/layers/mamba/mamba_utils.py kda_state_dtype, fp32 "
                   "recurrent state with mamba_ssm_cache_dtype auto"),
        Assumption("kda_conv_state_bytes_per_element", 2.0, "bytes",
                   "vllm: mamba_utils.py kda_state_dtype, conv state in the model dtype (bf16) "
                   "with mamba_cache_dtype auto"),
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
    )


def _k3_vision_params(hidden_size: int) -> int:
    """ViT + patchmergerv2 projector vLLM builds inside the engine, from KimiK3VisionConfig's
    defaults (kimi_k3_layout reads them off vllm/transformers_utils/configs/kimi_k3.py)."""
    vision = kimi_k3_layout._vision({})
    tensors = (kimi_k3_layout._vision_tower(vision, 1)
               + kimi_k3_layout._projector(vision, hidden_size))
    return sum(math.prod(t.shape) for t in tensors)


def _k3_vision(hidden_size: int) -> Assumption:
    params = _k3_vision_params(hidden_size)
    return Assumption("vision_encoder_params", params, "params",
                      "derived: vllm/models/kimi_k3/*/model.py builds MoonViT3dPretrainedModel + "
                      "KimiK25MultiModalProjector on every GPU, shapes from KimiK3VisionConfig "
                      "defaults (27 layers x 1024, 4096 MLP; the brief's 401M MoonViT-V2 + the "
                      f"{(params - 401_000_000) / 1e6:.1f}M projector to hidden_size)")


def _kimi_k3_runtime_reserve(hidden_size: int, top_k: int) -> tuple[Assumption, ...]:
    """What vLLM's start-up profiling takes beside the weights (gpu_worker.py
    determine_available_memory: profile_run peak + profile_cudagraph_memory + non-torch).
    vLLM measures these at start; without a K3 start log they are stated assumptions."""
    tokens = K3_MAX_NUM_BATCHED_TOKENS
    return (
        Assumption("moe_workspace_bytes_per_gpu", tokens * top_k * hidden_size * 2, "bytes",
                   f"assumption: fused-MoE workspace max_num_batched_tokens ({tokens}) x top_k "
                   f"({top_k}) x "
                   "hidden_size x 2 B (bf16, workspace sized M*topk*max(N, K)) at the profile "
                   "run's peak, because vLLM measures the real peak only at start"),
        Assumption("activation_bytes_per_gpu", tokens * hidden_size * 2 * 4, "bytes",
                   f"assumption: 4 live [{tokens}, hidden_size] bf16 activations (hidden, residual, "
                   "attention in/out) beside the MoE workspace, because vLLM measures the real "
                   "peak only at start"),
        Assumption("cudagraph_pool_bytes_per_gpu", 1 * GB, "bytes",
                   "assumption: 1 GB of graph pools, because vLLM estimates them only at start "
                   "(profile_cudagraph_memory; logged 0.2-0.4 GiB for small models, e.g. "
                   "gpustack/runner#251) and K3 captures 93 layers at many batch sizes"),
        Assumption("non_torch_bytes_per_gpu", 1 * GB, "bytes",
                   "assumption: 1 GB of RCCL / custom all-reduce buffers and HIP context, "
                   "because it is outside torch's allocator and only measurable on the GPU"),
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
    # vLLM keeps q_a and kv_a (fused_qkv_a_proj, disable_tp) unsharded on every rank; its K3 MLA
    # builds no sparse indexer (indexer=None), so no indexer weights are loaded.
    h, q_lora = int(v["hidden_size"]), int(v["q_lora_rank"])
    q_a = h * q_lora
    kv_a = h * int(v["kv_lora_rank"] + v["qk_rope_head_dim"])
    return q_a + kv_a


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
                             "derived: MLA q_a + kv_a per layer, which vLLM replicates on every TP "
                             "rank (no indexer weights: vLLM's K3 MLA has indexer=None)"),
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
    # vision.py is_vit_use_data_parallel: 12 ViT heads do not divide TP=8, so vLLM replicates the
    # ViT (data parallel); the projector is replicated in that mode too.
    groups.append(ParamGroup("vision_encoder", int(v["vision_encoder_params"]), "bf16", "vision",
                             False))
    records = [Assumption(f"{n}_params", counts[n], "params", layout[3])
               for n, layout in _K3_GROUP_LAYOUT.items()]
    return tuple(groups), tuple(records)


def _kimi_k3_1_pro() -> ModelSpec:
    assumptions = _kimi_k3_moe_and_dtypes() + _kimi_k3_cache_facts() + _kimi_k3_geometry()
    v = {a.name: a.value for a in assumptions}
    assumptions += (_k3_vision(int(v["hidden_size"])),)
    v["vision_encoder_params"] = assumptions[-1].value
    groups, group_records = _kimi_k3_param_groups(v)
    scalars = {name: v[name] for name in scalar_field_names()}
    reserve = _kimi_k3_runtime_reserve(int(v["hidden_size"]), int(v["num_experts_per_token"]))
    return ModelSpec(name="kimi-k3.1-pro", param_groups=groups, runtime_reserve=reserve,
                     assumptions=assumptions + group_records,
                     nominal_weight_inputs=_nominal_weight_inputs(group_records), **scalars)


# lightseekorg/kimi-k3-dspark config.json (K3DSparkModel, model.safetensors 7.12 GB in bf16).
K3_DSPARK_CONFIG = {
    "hidden_size": 7168, "intermediate_size": 14336, "num_hidden_layers": 5,
    "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "num_target_layers": 5,
    "target_hidden_size": 7168, "markov_rank": 256,
}
K3_DSPARK_SOURCE = "checkpoint config: lightseekorg/kimi-k3-dspark config.json"


def _dspark_layer_params(c: dict[str, int]) -> tuple[int, int]:
    """(TP-sharded, replicated) params of one K3DSparkDecoderLayer (vllm/models/kimi_k3/nvidia/
    dspark_mla.py: nvidia MultiHeadLatentAttention + KimiMLP)."""
    h, heads, q_lora, kv_lora = (c[k] for k in ("hidden_size", "num_attention_heads",
                                                "q_lora_rank", "kv_lora_rank"))
    nope, rope, v_dim, inter = (c[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim", "intermediate_size"))
    sharded = (q_lora * heads * (nope + rope)  # q_b_proj (ColumnParallel)
               + kv_lora * heads * (nope + v_dim)  # kv_b_proj (ColumnParallel)
               + heads * v_dim * h  # o_proj (RowParallel)
               + 3 * h * inter)  # gate_up_proj + down_proj
    replicated = (h * (q_lora + kv_lora + rope)  # fused_qkv_a_proj, disable_tp
                  + 2 * h + q_lora + kv_lora)  # layer norms, q_a / kv_a norms
    return sharded, replicated


def _dspark_shared_params(c: dict[str, int]) -> int:
    """Replicated params outside the layers: context_proj (ReplicatedLinear), context_kv_proj
    (disable_tp; a second copy of each layer's kv_a weights), Markov head (both matrices
    replicated, qwen3_dspark.DSparkMarkovHead), confidence head, context/final norms."""
    h, n, rank = c["hidden_size"], c["num_hidden_layers"], c["markov_rank"]
    context = c["target_hidden_size"] * c["num_target_layers"] * h
    context_kv = h * n * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
    markov = 2 * c["vocab_size"] * rank
    confidence = h + rank + 1
    return context + context_kv + markov + confidence + 2 * h


def _k3_dspark() -> DraftSpec:
    c = K3_DSPARK_CONFIG
    sharded, replicated = _dspark_layer_params(c)
    n = c["num_hidden_layers"]
    groups = (ParamGroup("draft_tp_sharded", n * sharded, "bf16", "draft", True),
              ParamGroup("draft_replicated", n * replicated + _dspark_shared_params(c), "bf16",
                         "draft", False))
    where = ("derived: vllm/models/kimi_k3/nvidia/dspark_mla.py layer shapes from "
             f"{K3_DSPARK_SOURCE.split(': ')[1]}, bf16 (no quantization_config); embeddings and "
             "LM head are the target's (has_own_embed_tokens/lm_head False)")
    return DraftSpec(
        name="kimi-k3-dspark", param_groups=groups, num_mla_layers=n,
        kv_lora_rank=c["kv_lora_rank"], qk_rope_head_dim=c["qk_rope_head_dim"],
        num_attention_heads=c["num_attention_heads"],
        assumptions=(
            Assumption("draft_num_attention_heads", c["num_attention_heads"], "heads",
                       f"{K3_DSPARK_SOURCE} num_attention_heads; a TRITON_MLA workspace is sized "
                       "by the heads per TP rank"),
            Assumption("draft_num_mla_layers", n, "layers",
                       f"{K3_DSPARK_SOURCE} num_hidden_layers; each K3DSparkDecoderLayer's MLA "
                       "returns an MLAAttentionSpec like the target's, so its KV joins the MLA "
                       "group"),
            *(Assumption(f"{g.name}_params", g.num_params, "params", where) for g in groups),
        ))


def _nominal_weight_inputs(group_records: tuple[Assumption, ...]) -> tuple[str, ...]:
    """Assumptions that only feed the nominal parameter counts; measured weights supersede them."""
    return (tuple(a.name for a in _kimi_k3_geometry()) + tuple(a.name for a in group_records)
            + ("total_params", "activated_params", "vision_encoder_params",
               "mxfp4_bytes_per_param", "fp8_bytes_per_param", "bf16_bytes_per_param"))


def _mi355x() -> HardwareSpec:
    return HardwareSpec(
        name="mi355x", gpus_per_node=8, hbm_bytes_per_gpu=288 * GB,
        hbm_bandwidth_bytes_per_s=8e12, compute_units=256,
        assumptions=(
            Assumption("compute_units", 256, "CUs per GPU",
                       "vendor spec: AMD Instinct MI355X, 256 compute units (vLLM's "
                       "num_compute_units caps TRITON_MLA's split-KV splits at twice this)"),
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
DRAFTS: dict[str, DraftSpec] = {"kimi-k3-dspark": _k3_dspark()}
HARDWARE: dict[str, HardwareSpec] = {"mi355x": _mi355x()}
