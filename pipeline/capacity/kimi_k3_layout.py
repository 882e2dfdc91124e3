"""The tensors vLLM's Kimi K3 loader expects in a checkpoint, derived from the checkpoint's config.

`check-checkpoint` compares a checkpoint's safetensors headers with `expected_tensors(...)`. Names,
shapes and tensor-parallel (TP) rules are read off vLLM 0.32's Kimi K3 implementation, AMD path
(the production target is MI355X); where NVIDIA's path differs it is said below:

* `vllm/models/kimi_k3/amd/model.py` `KimiK3ForConditionalGeneration.hf_to_vllm_mapper`: the
  checkpoint's `language_model.layers.` are the model's `language_model.model.layers.`, and
  `mm_projector.proj.0/2` are `mm_projector.linear_1/2`. `normalize_name` applies that mapping, so
  every name here is vLLM's (embeddings `language_model.model.embed_tokens.weight`, final norm
  `language_model.model.norm.weight`, head `language_model.lm_head.weight`).
* `vllm/models/kimi_k3/amd/linear.py`: `KimiDecoderLayer` (KDA when `layer + 1` is in
  `linear_attn_config.kda_layers`, MLA otherwise; MoE when `layer >= first_k_dense_replace` and
  `layer % moe_layer_freq == 0`), `KimiMLAAttention`, `KimiMoE`, `KimiMLP`, and `load_weights`,
  whose `stacked_params_mapping` gives the per-projection checkpoint names (`q_proj`, `k_proj`,
  `v_proj`, `g_proj`, `b_proj`, `f_a_proj`, `q_conv1d`..., `gate_proj`/`up_proj`, `q_a_proj`,
  `kv_a_proj_with_mqa`) and `fused_moe_make_expert_params_mapping(ckpt w1/w2/w3)` the per-expert
  ones: `block_sparse_moe.experts.{e}.w1|w2|w3.weight_packed` + `.weight_scale` (compressed-tensors
  MXFP4: packed uint8 `[N, K / 2]`, E8M0 uint8 `[N, K / 32]`), or `.weight` when unquantized.
* `vllm/models/kimi_k3/amd/kda.py` `KimiK3DeltaAttention` (`use_full_rank_gate`) and
  `vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py` (low-rank gate `g_a_proj` /
  `g_b_proj`; `A_log` `[H]` or the older `[1, 1, H, 1]`; conv weights `[C, 1, K]` or `[C, K]`).
* `vllm/model_executor/models/kimi_k25_vit.py` `MoonViT3dPretrainedModel` and
  `KimiK25MultiModalProjector` (`patchmergerv2`), fields and defaults from
  `vllm/transformers_utils/configs/kimi_k3.py` and `kimi_linear.py`.

TP rules (vLLM's layer classes): ColumnParallelLinear splits the output rows, RowParallelLinear the
input columns (both 1/TP of the bytes); ReplicatedLinear, `disable_tp=True` layers (`q_a_proj`,
`kv_a_proj_with_mqa`), `GateLinear` (router), the KDA `f_a_proj` shard and all norms are
replicated; VocabParallelEmbedding and ParallelLMHead split the vocabulary padded to a multiple of
64; routed experts split the intermediate dimension, padded to `min_moe_intermediate_per_partition`
(256) per rank when smaller; the ViT is split only when its heads divide TP (else vLLM runs it
data-parallel, replicated, as it does with `mm_encoder_tp_mode: data`, which a checkpoint does not
say). Not covered: MTP layers (`num_nextn_predict_layers`; the main model's loader skips them), the
NVIDIA-only `fused_qkv_a_g_proj` and mega-MoE paths, and the brief's MLA sparse-indexer weights,
which vLLM 0.32's Kimi K3 does not load (`indexer=None`).

Example:
    >>> cfg = KimiCheckpointConfig.from_dict(TINY_EXAMPLE)
    >>> names = [t.name for t in expected_tensors(cfg, tensor_parallel_size=1)]
    >>> names[0], len(names)
    ('model.embed_tokens.weight', 37)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

# linear / expert: stored as a float `.weight`, FP8 `.weight` + scale, or MXFP4 `.weight_packed`
# + `.weight_scale`; embedding / float: float dtypes only.
WeightKind = Literal["linear", "expert", "embedding", "float"]

SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")
VOCAB_PADDING = 64  # vllm vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
MIN_MOE_INTERMEDIATE_PER_PARTITION = 256  # KimiMoE's default for the per-rank padding
HF_TO_VLLM_PREFIXES = {  # KimiK3ForConditionalGeneration.hf_to_vllm_mapper
    "language_model.layers.": "language_model.model.layers.",
    "mm_projector.proj.0": "mm_projector.linear_1",
    "mm_projector.proj.2": "mm_projector.linear_2",
}


class ConfigError(ValueError):
    """config.json lacks a field the layout needs, or holds one of the wrong type."""


@dataclass(frozen=True)
class ExpectedTensor:
    name: str  # vLLM's name; linear weights end in `.weight` whatever their storage
    shape: tuple[int, ...]  # logical (MXFP4: unpacked elements)
    dims: str  # the config fields behind the shape, for error messages
    kind: WeightKind
    component: str
    rank_fraction: float  # share of the tensor one TP rank holds; 1.0 = replicated
    alt_shapes: tuple[tuple[int, ...], ...] = ()  # older layouts vLLM's loader also accepts


@dataclass(frozen=True)
class ModelFacts:
    """The numbers `moonserve plan` takes from a checkpoint config; names match ModelSpec's."""

    num_experts: int
    num_experts_per_token: int
    num_kda_layers: int
    num_mla_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_kernel_size: int


@dataclass(frozen=True)
class KdaConfig:
    kda_layers: frozenset[int]  # 1-based, as in linear_attn_config
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    use_full_rank_gate: bool


@dataclass(frozen=True)
class TextConfig:
    """KimiLinearConfig fields the layout reads (defaults are KimiLinearConfig's)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_experts: int | None
    num_experts_per_token: int | None
    moe_intermediate_size: int | None
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    min_moe_intermediate_per_partition: int
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    mla_use_output_gate: bool
    attn_res_block_size: int | None
    num_nextn_predict_layers: int
    kda: KdaConfig | None


@dataclass(frozen=True)
class VisionTowerConfig:
    """KimiK3VisionConfig fields the layout reads (defaults are KimiK3VisionConfig's)."""

    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    num_heads: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    qkv_hidden_size: int
    merge_kernel_size: tuple[int, int]
    projector_type: str
    norm_type: str
    attn_bias: bool
    linear_bias: bool
    patch_embed_proj_bias: bool


@dataclass(frozen=True)
class KimiCheckpointConfig:
    model_type: str
    text: TextConfig
    vision: VisionTowerConfig | None
    text_prefix: str  # "language_model." for kimi_k3, "" for kimi_linear
    mxfp4_experts: bool  # quantization_config names MXFP4: routed experts must be stored so

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KimiCheckpointConfig:
        """Parse config.json; ConfigError names a missing or mistyped field."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r}: the layout knows only "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        is_k3 = model_type == "kimi_k3"
        # KimiK3Config fills a missing vision_config with defaults, so K3 always has a ViT.
        text = (config.get("text_config") or {}) if is_k3 else config
        vision = (config.get("vision_config") or {}) if is_k3 else None
        quant = config.get("quantization_config") or text.get("quantization_config")
        return cls(model_type, _text_config(text), None if vision is None else _vision(vision),
                   "language_model." if is_k3 else "",
                   "mxfp4" in json.dumps(quant).lower() if quant else False)

    def facts(self) -> ModelFacts:
        t, kda = self.text, self.text.kda
        num_kda = sum(1 for i in range(t.num_hidden_layers) if is_kda_layer(t, i))
        return ModelFacts(t.num_experts or 0, t.num_experts_per_token or 0, num_kda,
                          t.num_hidden_layers - num_kda, t.kv_lora_rank or 0,
                          t.qk_rope_head_dim or 0, kda.num_heads if kda else 0,
                          kda.head_dim if kda else 0, kda.short_conv_kernel_size if kda else 0)


# ---- config.json -------------------------------------------------------------------------------


def _field(config: dict[str, Any], name: str, kind: type | tuple[type, ...] = int,
           default: Any = ..., *, where: str):
    value = config.get(name, default)
    if value is ...:
        raise ConfigError(f"config.json: {where}{name} is missing")
    wrong_type = value is not None and not isinstance(value, kind)
    if wrong_type or (isinstance(value, bool) and kind is int):  # bool is an int subclass
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"config.json: {where}{name} is {value!r}, expected {expected}")
    return value


def _text_config(c: dict[str, Any]) -> TextConfig:
    f = functools.partial(_field, c, where="text_config.")
    return TextConfig(
        f("vocab_size"), f("hidden_size"), f("num_hidden_layers"), f("num_attention_heads"),
        f("intermediate_size"), f("num_experts", int, None), f("num_experts_per_token", int, None),
        f("moe_intermediate_size", int, None), f("num_shared_experts", int, 0),
        f("first_k_dense_replace", int, 0), f("moe_layer_freq", int, 1),
        f("routed_expert_hidden_size", int, None), f("latent_moe_use_norm", bool, False),
        float(f("routed_scaling_factor", (int, float), 1.0)),
        f("min_moe_intermediate_per_partition", int, MIN_MOE_INTERMEDIATE_PER_PARTITION),
        f("q_lora_rank", int, None), f("kv_lora_rank", int, None),
        f("qk_nope_head_dim", int, None), f("qk_rope_head_dim", int, None),
        f("v_head_dim", int, None), bool(f("mla_use_output_gate", bool, False)),
        f("attn_res_block_size", int, None), f("num_nextn_predict_layers", int, 0),
        _kda_config(f("linear_attn_config", dict, None)),
    )


def _kda_config(c: dict[str, Any] | None) -> KdaConfig | None:
    if not c or not c.get("kda_layers"):
        return None
    f = functools.partial(_field, c, where="linear_attn_config.")
    return KdaConfig(frozenset(f("kda_layers", list)), f("num_heads"), f("head_dim"),
                     f("short_conv_kernel_size"), bool(f("use_full_rank_gate", bool, False)))


def _vision(c: dict[str, Any]) -> VisionTowerConfig:
    f = functools.partial(_field, c, where="vision_config.")
    merge = f("merge_kernel_size", list, [2, 2])
    return VisionTowerConfig(
        f("patch_size", int, 14), f("init_pos_emb_height", int, 64),
        f("init_pos_emb_width", int, 64), f("vt_num_attention_heads", int, 12),
        f("vt_num_hidden_layers", int, 27), f("vt_hidden_size", int, 1024),
        f("vt_intermediate_size", int, 4096), f("qkv_hidden_size", int, 1536),
        (int(merge[0]), int(merge[1])), f("mm_projector_type", str, "patchmergerv2"),
        f("norm_type", str, "rmsnorm"), f("attn_bias", bool, False),
        f("linear_bias", bool, False), f("patch_embed_proj_bias", bool, False),
    )


# ---- which layer is what -----------------------------------------------------------------------


def is_kda_layer(text: TextConfig, layer: int) -> bool:
    return text.kda is not None and layer + 1 in text.kda.kda_layers


def is_moe_layer(text: TextConfig, layer: int) -> bool:
    return (text.num_experts is not None and layer >= text.first_k_dense_replace
            and layer % text.moe_layer_freq == 0)


def normalize_name(name: str) -> str:
    """A checkpoint name as vLLM's Kimi K3 loader sees it (hf_to_vllm_mapper's prefixes)."""
    for old, new in HF_TO_VLLM_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_mtp_name(cfg: KimiCheckpointConfig, name: str) -> bool:
    """A multi-token-prediction layer (index >= num_hidden_layers): vLLM's main model skips it."""
    match = _LAYER_INDEX.search(name)
    return bool(match) and not name.startswith("vision_tower.") and \
        int(match.group(1)) >= cfg.text.num_hidden_layers


# ---- TP shares ---------------------------------------------------------------------------------


def _vocab_fraction(vocab_size: int, tp: int) -> float:
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return padded / tp / vocab_size


def moe_intermediate_fraction(text: TextConfig, tp: int) -> float:
    """Share of each routed expert one rank holds, with KimiMoE's per-rank padding."""
    size = text.moe_intermediate_size or 0
    padded = size
    if tp > 1 and size // tp < text.min_moe_intermediate_per_partition:
        padded = text.min_moe_intermediate_per_partition * tp
    return padded / tp / size


# ---- the expected tensors ----------------------------------------------------------------------


def expected_tensors(cfg: KimiCheckpointConfig, tensor_parallel_size: int) -> list[ExpectedTensor]:
    """Every tensor vLLM's loader needs for this config, with its logical shape and TP share."""
    tp, t, p = tensor_parallel_size, cfg.text, cfg.text_prefix + "model."
    out = [_float(f"{p}embed_tokens.weight", (t.vocab_size, t.hidden_size),
                  "[vocab_size, hidden_size]", "embed_tokens", _vocab_fraction(t.vocab_size, tp),
                  "embedding")]
    for layer in range(t.num_hidden_layers):
        out += _decoder_layer(t, f"{p}layers.{layer}.", layer, tp)
    out += _final_norms(t, p)
    out.append(ExpectedTensor(f"{cfg.text_prefix}lm_head.weight", (t.vocab_size, t.hidden_size),
                              "[vocab_size, hidden_size]", "embedding", "lm_head",
                              _vocab_fraction(t.vocab_size, tp)))
    if cfg.vision is not None:
        out += _vision_tower(cfg.vision, tp) + _projector(cfg.vision, t.hidden_size)
    return out


def _linear(name: str, out_dim: int, in_dim: int, dims: str, component: str,
            fraction: float) -> ExpectedTensor:
    return ExpectedTensor(f"{name}.weight", (out_dim, in_dim), dims, "linear", component, fraction)


def _float(name: str, shape: tuple[int, ...], dims: str, component: str, fraction: float = 1.0,
           kind: WeightKind = "float", alt_shapes: tuple[tuple[int, ...], ...] = ()):
    return ExpectedTensor(name, shape, dims, kind, component, fraction, alt_shapes)


def _decoder_layer(t: TextConfig, p: str, layer: int, tp: int) -> list[ExpectedTensor]:
    attention = (_kda if is_kda_layer(t, layer) else _mla)(t, p + "self_attn.", tp)
    mlp = _moe(t, p + "block_sparse_moe.", tp) if is_moe_layer(t, layer) else _mlp(
        p + "mlp.", t.hidden_size, t.intermediate_size, "intermediate_size", "dense_mlp", tp)
    return attention + mlp + _layer_norms(t, p)


def _layer_norms(t: TextConfig, p: str) -> list[ExpectedTensor]:
    h, dims = t.hidden_size, "[hidden_size]"
    out = [_float(f"{p}input_layernorm.weight", (h,), dims, "norms"),
           _float(f"{p}post_attention_layernorm.weight", (h,), dims, "norms")]
    if t.attn_res_block_size is not None:
        out += [_float(f"{p}self_attention_res_norm.weight", (h,), dims, "norms"),
                _float(f"{p}mlp_res_norm.weight", (h,), dims, "norms"),
                _float(f"{p}self_attention_res_proj.weight", (1, h), "[1, hidden_size]", "norms"),
                _float(f"{p}mlp_res_proj.weight", (1, h), "[1, hidden_size]", "norms")]
    return out


def _final_norms(t: TextConfig, p: str) -> list[ExpectedTensor]:
    out = [_float(f"{p}norm.weight", (t.hidden_size,), "[hidden_size]", "norms")]
    if t.attn_res_block_size is not None:
        out += [_float(f"{p}output_attn_res_norm.weight", (t.hidden_size,), "[hidden_size]",
                       "norms"),
                _float(f"{p}output_attn_res_proj.weight", (1, t.hidden_size), "[1, hidden_size]",
                       "norms")]
    return out


def _mlp(p: str, hidden: int, inter: int, inter_name: str, component: str,
         tp: int) -> list[ExpectedTensor]:
    up_dims = f"[{inter_name}, hidden_size]"
    return [_linear(f"{p}gate_proj", inter, hidden, up_dims, component, 1 / tp),
            _linear(f"{p}up_proj", inter, hidden, up_dims, component, 1 / tp),
            _linear(f"{p}down_proj", hidden, inter, f"[hidden_size, {inter_name}]", component,
                    1 / tp)]


def _kda(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    kda, h, c = t.kda, t.hidden_size, "kda_attention"
    assert kda is not None
    heads, dim = kda.num_heads, kda.head_dim
    proj, proj_dims = heads * dim, "[num_heads * head_dim, hidden_size]"
    out = [_linear(f"{p}{n}_proj", proj, h, proj_dims, c, 1 / tp) for n in ("q", "k", "v")]
    out += _kda_gate(kda, h, p, tp)
    out += [_linear(f"{p}b_proj", heads, h, "[num_heads, hidden_size]", c, 1 / tp),
            _linear(f"{p}f_a_proj", dim, h, "[head_dim, hidden_size]", c, 1.0),
            _linear(f"{p}f_b_proj", proj, dim, "[num_heads * head_dim, head_dim]", c, 1 / tp)]
    conv = (proj, 1, kda.short_conv_kernel_size)
    conv_dims = "[num_heads * head_dim, 1, short_conv_kernel_size]"
    out += [_float(f"{p}{n}_conv1d.weight", conv, conv_dims, c, 1 / tp,
                   alt_shapes=((proj, kda.short_conv_kernel_size),))
            for n in ("q", "k", "v")]
    out += [_float(f"{p}A_log", (heads,), "[num_heads]", c, 1 / tp, alt_shapes=((1, 1, heads, 1),)),
            _float(f"{p}dt_bias", (proj,), "[num_heads * head_dim]", c, 1 / tp),
            _float(f"{p}o_norm.weight", (dim,), "[head_dim]", c),
            _linear(f"{p}o_proj", h, proj, "[hidden_size, num_heads * head_dim]", c, 1 / tp)]
    return out


def _kda_gate(kda: KdaConfig, hidden: int, p: str, tp: int) -> list[ExpectedTensor]:
    proj, c = kda.num_heads * kda.head_dim, "kda_attention"
    if kda.use_full_rank_gate:
        return [_linear(f"{p}g_proj", proj, hidden, "[num_heads * head_dim, hidden_size]", c,
                        1 / tp)]
    return [_linear(f"{p}g_a_proj", kda.head_dim, hidden, "[head_dim, hidden_size]", c, 1.0),
            _linear(f"{p}g_b_proj", proj, kda.head_dim, "[num_heads * head_dim, head_dim]", c,
                    1 / tp)]


def _mla(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    h, heads, c = t.hidden_size, t.num_attention_heads, "mla_attention"
    nope, rope, v, kv = _required(t, "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                  "kv_lora_rank")
    out = _mla_query(t, p, tp)
    out += [_linear(f"{p}kv_a_proj_with_mqa", kv + rope, h,
                    "[kv_lora_rank + qk_rope_head_dim, hidden_size]", c, 1.0),
            _float(f"{p}kv_a_layernorm.weight", (kv,), "[kv_lora_rank]", c),
            _linear(f"{p}kv_b_proj", heads * (nope + v), kv,
                    "[num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]", c,
                    1 / tp),
            _linear(f"{p}o_proj", h, heads * v, "[hidden_size, num_attention_heads * v_head_dim]",
                    c, 1 / tp)]
    if t.mla_use_output_gate:
        out.append(_linear(f"{p}g_proj", heads * v, h,
                           "[num_attention_heads * v_head_dim, hidden_size]", c, 1 / tp))
    return out


def _mla_query(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    h, c = t.hidden_size, "mla_attention"
    q_out = t.num_attention_heads * sum(_required(t, "qk_nope_head_dim", "qk_rope_head_dim"))
    q_dims = "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
    if t.q_lora_rank is None:
        return [_linear(f"{p}q_proj", q_out, h, f"[{q_dims}, hidden_size]", c, 1 / tp)]
    q_lora = t.q_lora_rank
    return [_linear(f"{p}q_a_proj", q_lora, h, "[q_lora_rank, hidden_size]", c, 1.0),
            _float(f"{p}q_a_layernorm.weight", (q_lora,), "[q_lora_rank]", c),
            _linear(f"{p}q_b_proj", q_out, q_lora, f"[{q_dims}, q_lora_rank]", c, 1 / tp)]


def _required(t: TextConfig, *names: str) -> tuple[int, ...]:
    missing = [n for n in names if getattr(t, n) is None]
    if missing:
        raise ConfigError(f"config.json: text_config.{missing[0]} is missing (MLA layers need it)")
    return tuple(getattr(t, n) for n in names)


def _moe(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    (experts, inter) = _required(t, "num_experts", "moe_intermediate_size")
    h = t.hidden_size
    out = [_float(f"{p}gate.weight", (experts, h), "[num_experts, hidden_size]", "moe_router"),
           _float(f"{p}gate.e_score_correction_bias", (experts,), "[num_experts]", "moe_router")]
    if t.num_shared_experts:
        out += _mlp(f"{p}shared_experts.", h, inter * t.num_shared_experts,
                    "moe_intermediate_size * num_shared_experts", "shared_experts", tp)
    out += _latent_projections(t, p, tp)
    for expert in range(experts):
        out += _expert(t, f"{p}experts.{expert}.", tp)
    return out


def _expert(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    inter, hidden = t.moe_intermediate_size or 0, t.routed_expert_hidden_size or t.hidden_size
    h_name = "routed_expert_hidden_size" if t.routed_expert_hidden_size else "hidden_size"
    fraction = moe_intermediate_fraction(t, tp)
    up, down = f"[moe_intermediate_size, {h_name}]", f"[{h_name}, moe_intermediate_size]"
    return [ExpectedTensor(f"{p}{w}.weight", shape, dims, "expert", "routed_experts", fraction)
            for w, shape, dims in (("w1", (inter, hidden), up), ("w3", (inter, hidden), up),
                                   ("w2", (hidden, inter), down))]


def _latent_projections(t: TextConfig, p: str, tp: int) -> list[ExpectedTensor]:
    latent, h, c = t.routed_expert_hidden_size, t.hidden_size, "latent_moe"
    if latent is None:
        return []
    shard_up = (tp > 1 and h % tp == 0 and t.num_shared_experts is not None
                and t.routed_scaling_factor == 1.0)
    out = [_linear(f"{p}routed_expert_down_proj", latent, h,
                   "[routed_expert_hidden_size, hidden_size]", c, 1.0),
           _linear(f"{p}routed_expert_up_proj", h, latent,
                   "[hidden_size, routed_expert_hidden_size]", c, 1 / tp if shard_up else 1.0)]
    if t.latent_moe_use_norm:
        out.append(_float(f"{p}routed_expert_norm.weight", (latent,),
                          "[routed_expert_hidden_size]", c))
    return out


def _vision_tower(v: VisionTowerConfig, tp: int) -> list[ExpectedTensor]:
    p, c = "vision_tower.", "vision"
    out = [_float(f"{p}patch_embed.proj.weight", (v.hidden_size, 3, v.patch_size, v.patch_size),
                  "[vt_hidden_size, 3, patch_size, patch_size]", c),
           _float(f"{p}patch_embed.pos_emb.weight", (v.pos_emb_height, v.pos_emb_width,
                  v.hidden_size), "[init_pos_emb_height, init_pos_emb_width, vt_hidden_size]", c)]
    if v.patch_embed_proj_bias:
        out.append(_float(f"{p}patch_embed.proj.bias", (v.hidden_size,), "[vt_hidden_size]", c))
    for block in range(v.num_layers):
        out += _vision_block(v, f"{p}encoder.blocks.{block}.", tp)
    return out + _vision_norm(v, f"{p}encoder.final_layernorm")


def _vision_norm(v: VisionTowerConfig, name: str) -> list[ExpectedTensor]:
    parts = ("weight", "bias") if v.norm_type == "layernorm" else ("weight",)
    return [_float(f"{name}.{part}", (v.hidden_size,), "[vt_hidden_size]", "vision")
            for part in parts]


def _vision_block(v: VisionTowerConfig, p: str, tp: int) -> list[ExpectedTensor]:
    share = 1 / tp if v.num_heads % tp == 0 else 1.0  # else vLLM runs the ViT data-parallel
    hid, qkv, inter = v.hidden_size, v.qkv_hidden_size, v.intermediate_size
    out = _vision_norm(v, f"{p}norm0") + _vision_norm(v, f"{p}norm1")
    out += _vision_linear(f"{p}wqkv", 3 * qkv, hid, "[3 * qkv_hidden_size, vt_hidden_size]",
                          v.attn_bias, share, share)
    out += _vision_linear(f"{p}wo", hid, qkv, "[vt_hidden_size, qkv_hidden_size]", v.attn_bias,
                          share, 1.0)
    out += _vision_linear(f"{p}mlp.fc0", inter, hid, "[vt_intermediate_size, vt_hidden_size]",
                          v.linear_bias, share, share)
    out += _vision_linear(f"{p}mlp.fc1", hid, inter, "[vt_hidden_size, vt_intermediate_size]",
                          v.linear_bias, share, 1.0)
    return out


def _vision_linear(name: str, out_dim: int, in_dim: int, dims: str, bias: bool, share: float,
                   bias_share: float) -> list[ExpectedTensor]:
    weight = _linear(name, out_dim, in_dim, dims, "vision", share)
    if not bias:
        return [weight]
    bias_dims = dims.split(",")[0] + "]"
    return [weight, _float(f"{name}.bias", (out_dim,), bias_dims, "vision", bias_share)]


def _projector(v: VisionTowerConfig, text_hidden: int) -> list[ExpectedTensor]:
    merged = v.hidden_size * v.merge_kernel_size[0] * v.merge_kernel_size[1]
    p, m = "mm_projector.", "vt_hidden_size * merge_kernel_size area"
    v2 = v.projector_type == "patchmergerv2"
    out = _vision_linear(f"{p}linear_1", merged, merged, f"[{m}, {m}]", not v2, 1.0, 1.0)
    out += _vision_linear(f"{p}linear_2", text_hidden, merged, f"[hidden_size, {m}]", not v2,
                          1.0, 1.0)
    if v2:
        return out + [_float(f"{p}post_norm.weight", (text_hidden,), "[hidden_size]", "vision")]
    return out + [_float(f"{p}pre_norm.{part}", (v.hidden_size,), "[vt_hidden_size]", "vision")
                  for part in ("weight", "bias")]


# A 2-layer Kimi Linear config (1 KDA + 1 MLA layer, 2 experts) for the module example.
TINY_EXAMPLE: dict[str, Any] = {
    "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "intermediate_size": 128, "num_experts": 2,
    "num_experts_per_token": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                           "head_dim": 16, "short_conv_kernel_size": 4,
                           "use_full_rank_gate": True},
}
