"""The DSpark block-drafting model in plain PyTorch: over tokens only, or (`conditioned=True`) with
`context_proj` and `context_norm` over the target's hidden states, as K3's DSpark.

The drafters over it: `moonserve.pipeline.speculative.dspark` (tokens only, described below) and
`moonserve.pipeline.speculative.dspark_context` (vLLM's scheme, from the target's hidden states,
batched across requests).

The token-only scheme follows vLLM's DSpark speculator (`vllm/v1/worker/gpu/spec_decode/dspark/`)
and its draft models (`qwen3_dspark.py`, K3's dense MLA `dspark_mla.py`), minus the target's hidden
states. Per request and `propose(k)`, greedy:

1. ONE forward pass over `[context tokens not yet cached (the last is the anchor)] + [k - 1 query
   slots holding the mask embedding]`, causal over the KV cache plus these rows. Real tokens' KV
   stays in the cache; the query slots' KV is dropped.
2. The hidden states at the anchor and the k - 1 slots -> final norm -> the target's LM head:
   base logits `[k, vocab]` (the anchor predicts the first draft, "anchor-as-first-prediction").
3. The sequential Markov head: `prev = anchor`; for i in 0..k-1:
   `d_i = argmax(base[i] + markov_w2 @ markov_w1[prev])`; `prev = d_i`
   (`DSparkMarkovHead` of `qwen3_dspark.py`, a rank-`markov_rank` transition bias).

Where the token-only drafter differs from vLLM: vLLM's draft attends to context KV projected from
the target's hidden states (`context_proj`) and its query block is non-causal; here the context is
the drafter's own encoding of the tokens and everything is causal, so the drafter is an ordinary
small LM over the context plus a parallel block. K3 DSpark tensors load by name
(`layers.N.self_attn.q_a_proj.weight`, ..., `final_norm.weight`, `markov_head.markov_w{1,2}.weight`;
`context_proj`, `context_norm` and `confidence_head` are ignored), but weights trained for vLLM's
conditioning draft poorly here: for them, `dspark_context`.

Attention is either DeepSeek-V3/K3 MLA (`attention_type="mla"`: cached as the normalized latent plus
the shared RoPE key, `kv_lora_rank + qk_rope_head_dim` floats per token and layer, attended with the
absorbed `kv_b_proj`, as vLLM's MLA decode does) or Llama GQA (`"gqa"`), which the embedded build
uses because it copies SmolLM2 layers as they are.

Measurements of the embedded drafter (layer choice, MXFP4): docs/speculative.md.

MXFP4: a checkpoint may ship linear weights as gpt-oss does, `X.weight_blocks` uint8
`[out, in // 32, 16]` + `X.weight_scales` uint8 `[out, in // 32]` instead of `X.weight`
(attention and MLP projections, the Markov head's `markov_w2`, an untied LM head); `load_model`
loads them with `moonserve.kernels.mxfp4.linear.load_weights`, so those linears run as `MXFP4Linear` (Triton
on GPU, decoded per matmul in torch on CPU). `quantize_drafter_checkpoint` writes such a copy.

Example:
    >>> config = DSparkConfig(hidden_size=32, vocab_size=100, num_hidden_layers=1,
    ...                       num_attention_heads=2, intermediate_size=64, attention_type="gqa",
    ...                       num_key_value_heads=1, head_dim=16, markov_rank=4)
    >>> model = DSparkModel(config)                      # random weights
    >>> cache = model.new_cache()
    >>> hidden = model(model.embed_block([5, 6, 7], num_query_slots=3), cache)  # [3 + 3, hidden]
    >>> model.compute_logits(hidden[2:]).shape           # the anchor and the 3 query slots
    torch.Size([4, 100])
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moonserve.kernels.mxfp4.format import BLOCKS_SUFFIX, SCALES_SUFFIX, is_packed_part
from moonserve.kernels.mxfp4.linear import (
    MXFP4Linear,
    check_pair,
    load_weights,
    packed_weight_names,
    packed_weight_shape,
)
from moonserve.kernels.mxfp4.naive import dequantize
from moonserve.pipeline.models.weights import (
    CONFIG_FILE,
    LM_HEAD_NAMES,
    TOKEN_EMBEDDING_NAMES,
    WEIGHTS_FILE,
    find_tensor,
    place_tensors,
    read_tensors,
    tensor_files,
)

MODEL_TYPE = "moonserve_dspark"
ATTENTION_TYPES = ("mla", "gqa")
DEFAULT_MARKOV_RANK = 64  # the embedded build's rank
# Tensors of a K3 DSpark checkpoint a token-only drafter has no input for: the projection of the
# target's hidden states into the context (and its fused per-layer KV copy), and the training-time
# acceptance-probability head. A drafter conditioned on the target's hidden states
# (`DSparkModel(conditioned=True)`) loads `context_proj` and `context_norm`.
CONTEXT_PREFIXES = ("context_proj.", "context_norm.")
IGNORED_PREFIXES = (*CONTEXT_PREFIXES, "context_kv_proj.", "confidence_head.")
SHARED_EMBEDDING_HINT = ("pass the target's embedding: DSparkDrafter.from_pretrained(path, "
                         "shared=target_shared_tensors(target_dir))")


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter's `config.json`; field names follow K3DSparkConfig / DeepseekV3Config.

    `attention_type="mla"` reads `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    `qk_rope_head_dim`, `v_head_dim`; `"gqa"` reads `num_key_value_heads` and `head_dim`.
    `mask_token_id`: the query slots' input is that token's embedding (vLLM's convention); None:
    a learned or derived `mask_embedding` tensor `[hidden_size]`.
    `target_layer_ids`: the target layers the drafter was built from (or whose hidden states a
    conditioned drafter reads). `target_hidden_size` and `num_target_layers` size the conditioned
    drafter's `context_proj` (`[hidden_size, target_hidden_size * num_target_layers]`).
    `shares_target_embedding`: the checkpoint ships neither `embed_tokens.weight` nor an LM head;
    both are the target's, passed to `DSparkDrafter.from_pretrained` as `shared` (see
    `target_shared_tensors`). A K3 draft omits them too without saying so; loading either without
    them raises an error that says to pass them.
    """

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    attention_type: str = "mla"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    markov_rank: int = DEFAULT_MARKOV_RANK
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] = ()
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    max_position_embeddings: int = 4096
    shares_target_embedding: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "markov_rank", "max_position_embeddings"):
            self._require_positive_int(name)
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DSparkConfig.{name} must be a positive number, got {value!r}")
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"DSparkConfig.attention_type must be one of {ATTENTION_TYPES}, "
                             f"got {self.attention_type!r}")
        if self.attention_type == "mla":
            self._validate_mla()
        else:
            self._validate_gqa()
        self._validate_ids()
        for name in ("target_hidden_size", "num_target_layers"):
            if getattr(self, name) is not None:
                self._require_positive_int(name)
        if type(self.shares_target_embedding) is not bool:  # 1 is no JSON boolean
            raise ValueError(f"DSparkConfig.shares_target_embedding must be true or false, "
                             f"got {self.shares_target_embedding!r}")

    def _require_positive_int(self, name: str, needed_by: str = "") -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"DSparkConfig.{name} must be a positive integer{needed_by}, "
                             f"got {value!r}")

    def _validate_mla(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            self._require_positive_int(name, needed_by=" for attention_type 'mla'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DSparkConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                             f"got {self.qk_rope_head_dim}")

    def _validate_gqa(self) -> None:
        for name in ("num_key_value_heads", "head_dim"):
            self._require_positive_int(name, needed_by=" for attention_type 'gqa'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DSparkConfig.num_key_value_heads ({self.num_key_value_heads}) "
                             f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"DSparkConfig.head_dim must be even (RoPE rotates pairs), "
                             f"got {self.head_dim}")

    def _validate_ids(self) -> None:
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DSparkConfig.mask_token_id must be in [0, vocab_size="
                             f"{self.vocab_size}), got {self.mask_token_id!r}")
        if any(not isinstance(i, int) or i < 0 for i in self.target_layer_ids):
            raise ValueError(f"DSparkConfig.target_layer_ids must be non-negative integers, "
                             f"got {self.target_layer_ids!r}")

    @property
    def context_width(self) -> int:
        """Width of one token's target hidden states as a conditioned drafter reads them: the
        `num_target_layers` layers' states concatenated."""
        if self.target_hidden_size is None or self.num_target_layers is None:
            raise ValueError("DSparkConfig: target_hidden_size and num_target_layers are needed "
                             "to condition the drafter on the target's hidden states")
        return self.target_hidden_size * self.num_target_layers

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    @classmethod
    def from_dict(cls, data: Mapping) -> DSparkConfig:
        """The fields above from a `config.json` dict; other keys (a K3 config also carries
        DeepseekV3's MoE and training settings) are ignored."""
        check_supported(data)
        names = {f.name for f in fields(cls)}
        values = {name: value for name, value in data.items() if name in names}
        mask_token_id = mask_token_of(data)
        if mask_token_id is not None:
            values["mask_token_id"] = mask_token_id
        rope = data.get("rope_parameters") or {}
        if "rope_theta" in rope:
            values.setdefault("rope_theta", rope["rope_theta"])
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"DSparkConfig: {', '.join(missing)} missing from the config")
        return cls(**values)

    def to_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, path: Path) -> DSparkConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read a DSpark config: {exc}") from exc
        return cls.from_dict(data)

    def to_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def mask_token_of(data: Mapping) -> int | None:
    """The query slots' token, looked up as vLLM's `get_parallel_drafting_token_id` does:
    `dflash_config.mask_token_id`, then `mask_token_id`, then `dspark_noise_token_id`."""
    dflash = data.get("dflash_config") or {}
    for value in (dflash.get("mask_token_id"), data.get("mask_token_id"),
                  data.get("dspark_noise_token_id")):
        if value is not None:
            return value
    return None


def check_supported(data: Mapping) -> None:
    """Reject config.json settings this implementation would otherwise silently get wrong."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"DSparkConfig.rope_parameters.rope_type: only 'default' RoPE is "
                         f"implemented, got {rope.get('rope_type', rope.get('type'))!r}")
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DSparkConfig.hidden_act: only 'silu' (SwiGLU) is implemented, "
                         f"got {data['hidden_act']!r}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, `[num_tokens, dim // 2]` each (transformers' default
    RoPE, computed in float32)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, dim]`. `interleaved`: DeepSeek's pairs (x0, x1), ...,
    returned de-interleaved like transformers does (q and k alike, so q.k is unchanged);
    otherwise Llama's halves."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_past: int
) -> torch.Tensor:
    """Causal attention of `num_new` queries placed after `num_past` cached tokens.

    q `[num_new, num_heads, E]`, k `[num_past + num_new, num_kv_heads, E]`,
    v `[num_past + num_new, num_kv_heads, Ev]` -> `[num_new, num_heads, Ev]`.
    """
    num_new, num_keys = q.shape[0], k.shape[0]
    keys, queries = torch.arange(num_keys, device=q.device), torch.arange(num_new, device=q.device)
    mask = keys[None, :] <= num_past + queries[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def linear_weight(linear: nn.Linear | MXFP4Linear, dtype: torch.dtype) -> torch.Tensor:
    """The `[out, in]` matrix of a linear, decoded if it is MXFP4, for the few places that use
    the matrix itself rather than a matmul (MLA weight absorption, deriving the Markov head)."""
    if isinstance(linear, MXFP4Linear):
        return dequantize(linear.weight_blocks, linear.weight_scales, dtype)
    return linear.weight


class LayerKV:
    """One layer's cached rows (one or more tensors), grown by doubling; truncation is O(1)."""

    def __init__(self, num_tensors: int):
        self._data: list[torch.Tensor | None] = [None] * num_tensors
        self.num_tokens = 0

    def extend(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append `rows` (each `[num_new, ...]`); returns every cached row, `[num_tokens, ...]`."""
        end = self.num_tokens + rows[0].shape[0]
        for i, new in enumerate(rows):
            data = self._data[i]
            if data is None or data.shape[0] < end:
                grown = new.new_empty((max(end, 2 * (0 if data is None else data.shape[0]), 64),
                                       *new.shape[1:]))
                if data is not None:
                    grown[: self.num_tokens] = data[: self.num_tokens]
                self._data[i] = data = grown
            data[self.num_tokens : end] = new
        self.num_tokens = end
        return tuple(data[:end] for data in self._data)

    def truncate(self, num_tokens: int) -> None:
        self.num_tokens = min(self.num_tokens, num_tokens)

    def rows(self, index: int = 0) -> torch.Tensor | None:
        """Tensor `index`'s cached rows, `[num_tokens, ...]`; None before the first `extend`."""
        data = self._data[index]
        return None if data is None else data[: self.num_tokens]


class DSparkCache:
    """Per-layer KV of one request's context tokens `[0, num_tokens)`."""

    def __init__(self, num_layers: int, num_tensors: int):
        self.layers = [LayerKV(num_tensors) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_tokens

    def truncate(self, num_tokens: int) -> None:
        for layer in self.layers:
            layer.truncate(num_tokens)


class GQAttention(nn.Module):
    """Llama attention (q/k/v/o_proj, `num_key_value_heads`); caches roped k and v."""

    num_cache_tensors = 2

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_width, kv_width = (config.hidden_size, self.num_heads * self.head_dim,
                                     self.num_kv_heads * self.head_dim)
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple, kv: LayerKV) -> torch.Tensor:
        num_new = x.shape[0]
        q = apply_rope(self.q_proj(x).view(num_new, self.num_heads, -1), *rope, interleaved=False)
        k = apply_rope(self.k_proj(x).view(num_new, self.num_kv_heads, -1), *rope,
                       interleaved=False)
        num_past = kv.num_tokens
        keys, values = kv.extend(k, self.v_proj(x).view(num_new, self.num_kv_heads, -1))
        out = attend(q, keys, values, self.head_dim**-0.5, num_past)  # [num_new, heads, head_dim]
        return self.o_proj(out.reshape(num_new, -1))

    def attend_self(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output at position 0 of a one-token context, `[batch, hidden]`: the softmax
        over one key is 1, so it is the projected value."""
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, -1)
        v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        return self.o_proj(v.reshape(x.shape[0], -1))


class MLAttention(nn.Module):
    """DeepSeek-V3 / K3 multi-head latent attention, tensor names as in their checkpoints.

    Caches `[kv_a_layernorm(latent), rope(k_pe)]`, `[num_tokens, kv_lora_rank + qk_rope_head_dim]`
    (vLLM's MLA cache row), and attends in latent space: `kv_b_proj` is split into W_UK, applied
    to the query, and W_UV, applied to the attention output (weight absorption).
    """

    num_cache_tensors = 1

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank,
                                  self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank,
                                   self.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple, kv: LayerKV) -> torch.Tensor:
        num_new = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(num_new, self.num_heads, -1)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        num_past = kv.num_tokens
        (rows,) = kv.extend(self.latent_rows(x, rope))  # [num_past + num_new, kv_lora + rope]
        w_uk, w_uv = self.absorbed_weights(q.dtype)
        query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk),
                           apply_rope(q_pe, *rope, interleaved=True)], dim=-1)
        latent_out = attend(query, rows[:, None], rows[:, None, : self.kv_lora_rank], self.scale,
                            num_past)  # [num_new, heads, kv_lora_rank]
        out = torch.einsum("thc,hvc->thv", latent_out, w_uv)
        return self.o_proj(out.reshape(num_new, -1))

    def latent_rows(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """The cache rows of `x`, `[num_tokens, kv_lora_rank + qk_rope_head_dim]`."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        k_pe = apply_rope(k_pe[:, None, :], *rope, interleaved=True)[:, 0]
        return torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)

    def absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK `[heads, qk_nope_head_dim, kv_lora_rank]`,
        W_UV `[heads, v_head_dim, kv_lora_rank]`."""
        # An MXFP4 kv_b_proj is decoded per pass: the MLA path is the reference, not the fast one.
        w = linear_weight(self.kv_b_proj, dtype).view(self.num_heads, self.nope_dim + self.v_head_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def attend_self(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output of a one-token context, `[batch, hidden]` (see GQAttention)."""
        latent = self.kv_a_proj_with_mqa(x)[:, : self.kv_lora_rank]
        v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(x.shape[0], self.num_heads, -1)
        return self.o_proj(v[..., self.nope_dim :].reshape(x.shape[0], -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm dense decoder layer: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        attention = MLAttention if config.attention_type == "mla" else GQAttention
        self.self_attn = attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple, kv: LayerKV) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_single_token(self, h: torch.Tensor) -> torch.Tensor:
        """`[batch, hidden]`, each row its own one-token context at position 0."""
        h = h + self.self_attn.attend_self(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class DSparkMarkovHead(nn.Module):
    """Low-rank transition bias `markov_w2.weight @ markov_w1.weight[prev]`, `[vocab]`
    (vLLM's `DSparkMarkovHead`: V x r embedding, r -> V projection)."""

    def __init__(self, vocab_size: int, markov_rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)

    def bias(self, token_id: int) -> torch.Tensor:
        return self.markov_w2(self.markov_w1.weight[token_id])


class DSparkModel(nn.Module):
    """Embedding, dense decoder stack, final norm, Markov head; LM head tied unless given.

    Example:
        >>> model = DSparkModel(DSparkConfig(
        ...     hidden_size=32, vocab_size=100, num_hidden_layers=1, num_attention_heads=2,
        ...     intermediate_size=64, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        ...     qk_rope_head_dim=4, v_head_dim=8, markov_rank=4))       # MLA
        >>> cache = model.new_cache()
        >>> model(model.embed_block([5, 6, 7], num_query_slots=3), cache).shape
        torch.Size([6, 32])
        >>> cache.num_tokens        # rows of kv_lora_rank + qk_rope_head_dim = 12 floats
        6
        >>> cache.truncate(3)       # what DSparkState does next: drop the query slots' rows
    """

    def __init__(self, config: DSparkConfig, tie_word_embeddings: bool = True,
                 conditioned: bool = False):
        super().__init__()
        self.config = config
        self.conditioned = conditioned
        if conditioned:
            if config.attention_type != "mla":
                raise ValueError("DSparkConfig.attention_type: a drafter conditioned on the "
                                 "target's hidden states is K3's MLA DSpark; got "
                                 f"{config.attention_type!r}")
            if config.mask_token_id is None:
                raise ValueError("DSparkConfig.mask_token_id: the query slots' token is needed "
                                 "(K3 DSpark configs name it mask_token_id or "
                                 "dspark_noise_token_id)")
            # vLLM's K3DSparkModel.combine_hidden_states: context_norm(context_proj(states)).
            self.context_proj = nn.Linear(config.context_width, config.hidden_size, bias=False)
            self.context_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mask_embedding = (nn.Parameter(torch.zeros(config.hidden_size))
                               if config.mask_token_id is None else None)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.markov_head = DSparkMarkovHead(config.vocab_size, config.markov_rank)
        self.lm_head = (None if tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[vocab, hidden]`: the target's LM head (the embedding when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return linear_weight(self.lm_head, self.embed_tokens.weight.dtype)

    def new_cache(self) -> DSparkCache:
        return DSparkCache(len(self.layers), self.layers[0].self_attn.num_cache_tensors)

    def embed_block(self, token_ids: Sequence[int], num_query_slots: int) -> torch.Tensor:
        """Inputs of a block pass: the tokens' embeddings, then the mask embedding per query
        slot, `[len(token_ids) + num_query_slots, hidden]`."""
        device = self.embed_tokens.weight.device
        tokens = self.embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=device))
        if self.mask_embedding is None:
            mask = self.embed_tokens.weight[self.config.mask_token_id]
        else:
            mask = self.mask_embedding
        return torch.cat([tokens, mask.expand(num_query_slots, -1)])

    def forward(self, inputs_embeds: torch.Tensor, cache: DSparkCache) -> torch.Tensor:
        """Causal pass of `inputs_embeds` `[num_new, hidden]` placed after the cached tokens;
        appends their KV to `cache`; returns final-normed hidden states `[num_new, hidden]`."""
        start = cache.num_tokens
        positions = torch.arange(start, start + inputs_embeds.shape[0],
                                 device=inputs_embeds.device)
        rope = rope_cos_sin(positions, self.config.rope_dim, self.config.rope_theta,
                            inputs_embeds.dtype)
        h = inputs_embeds
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            h = layer(h, rope, kv)
        return self.final_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[n, vocab]`, in float32."""
        if self.lm_head is None:
            return (hidden @ self.embed_tokens.weight.T).float()
        return self.lm_head(hidden).float()

    def markov_decode(self, base_logits: torch.Tensor, anchor_id: int) -> list[int]:
        """Greedy sequential Markov stage over base logits `[k, vocab]`: k draft ids."""
        drafts, prev = [], anchor_id
        for logits in base_logits:
            prev = int(torch.argmax(logits + self.markov_head.bias(prev).float()))
            drafts.append(prev)
        return drafts

    def single_token_hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden state of each one-token context `[t]`, `[batch, hidden]`."""
        h = self.embed_tokens(token_ids)
        for layer in self.layers:
            h = layer.forward_single_token(h)
        return self.final_norm(h)


def load_model(
    config: DSparkConfig,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    conditioned: bool = False,
) -> DSparkModel:
    """Build a `DSparkModel` from named tensors, checking names and shapes against `config`;
    `conditioned`: with `context_proj` and `context_norm` (see `DSparkModel`).

    A linear weight `X.weight` may come as MXFP4, gpt-oss style: `X.weight_blocks` uint8
    `[out, in // 32, 16]` + `X.weight_scales` uint8 (or float8_e8m0fnu) `[out, in // 32]`; that
    linear then runs as an `MXFP4Linear` (`moonserve.kernels.mxfp4.linear.load_weights`; packed tensors keep
    their dtype, float ones are cast to `dtype`).
    """
    ignored = tuple(p for p in IGNORED_PREFIXES if not (conditioned and p in CONTEXT_PREFIXES))
    tensors = {name: t for name, t in tensors.items() if not name.startswith(ignored)}
    check_embedding_present(config, tensors, source)
    untied = any(name in tensors for name in ("lm_head.weight", "lm_head.weight" + BLOCKS_SUFFIX))
    with torch.device("meta"):
        model = DSparkModel(config, tie_word_embeddings=not untied, conditioned=conditioned)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    check_tensor_names(expected, logical_shapes(model, tensors, source), source)
    load_weights(model, place_tensors(tensors, device, dtype), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def check_embedding_present(
    config: DSparkConfig, tensors: Mapping[str, torch.Tensor], source: str
) -> None:
    if "embed_tokens.weight" in tensors:
        return
    why = ("its config.json says shares_target_embedding" if config.shares_target_embedding
           else "the checkpoint ships no embedding")
    raise ValueError(f"{source}: missing tensors: embed_tokens.weight: this drafter uses the "
                     f"target's embedding ({why}); {SHARED_EMBEDDING_HINT}")


def logical_shapes(
    model: DSparkModel, tensors: Mapping[str, torch.Tensor], source: str
) -> dict[str, tuple[int, ...]]:
    """Name -> shape, with each MXFP4 pair as its logical `X.weight` `[out, in]`."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if not is_packed_part(name)}
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name in packed_weight_names(tensors):
        blocks, scales = check_pair(name, tensors)
        shape = packed_weight_shape(blocks, scales)
        if name not in linears or shape is None:
            raise ValueError(
                f"{source}: {name}{BLOCKS_SUFFIX} {list(blocks.shape)} + {name}{SCALES_SUFFIX} "
                f"{list(scales.shape)}: MXFP4 pairs must be [out, in // 32, 16] + [out, in // 32] "
                f"and name the weight of a linear (projections, markov_w2, lm_head)")
        shapes[name] = shape
    return shapes


def check_tensor_names(
    expected: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]], source: str
) -> None:
    missing = [name for name in expected if name not in shapes]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8
                                          else "")
        raise ValueError(f"{source}: missing tensors: {shown}")
    unexpected = sorted(name for name in shapes if name not in expected)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors for this config.json: "
                         f"{', '.join(unexpected[:8])}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(f"{source}: tensor {name} has shape {shapes[name]}, "
                             f"config.json implies {shape}")


def save_model(model: DSparkModel, out_dir: Path) -> None:
    """`config.json` + `model.safetensors`; a tied LM head is stored once, as the embedding, and
    neither is stored when `config.shares_target_embedding`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.to_json(out_dir / CONFIG_FILE)
    omitted = (("embed_tokens.weight", "lm_head.weight") if model.config.shares_target_embedding
               else ())
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name not in omitted}
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def target_shared_tensors(lm_dir: Path | str) -> dict[str, torch.Tensor]:
    """The target's tensors a drafter shares: `embed_tokens.weight` `[vocab, hidden]`, plus
    `lm_head.weight` `[vocab, hidden]` when the checkpoint has an LM head of its own (untied);
    read alone with `safe_open` (one file or a sharded `model.safetensors.index.json`), in the
    checkpoint's dtype.

    >>> lm_dir = prepare_language_model()  # doctest: +SKIP
    >>> drafter = DSparkDrafter.from_pretrained(drafter_dir,  # doctest: +SKIP
    ...                                         shared=target_shared_tensors(lm_dir))
    """
    files = tensor_files(lm_dir)
    embedding = find_tensor(files, TOKEN_EMBEDDING_NAMES)
    if embedding is None:
        raise ValueError(f"{lm_dir}: no target embedding to share: none of "
                         f"{', '.join(TOKEN_EMBEDDING_NAMES)} in its safetensors")
    shared = {"embed_tokens.weight": embedding}
    lm_head = find_tensor(files, LM_HEAD_NAMES)
    if lm_head is not None:
        shared["lm_head.weight"] = lm_head
    tensors = read_tensors(files, shared.values())
    return {name: tensors[src] for name, src in shared.items()}
