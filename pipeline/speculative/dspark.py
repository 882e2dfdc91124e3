"""DSpark-style block drafting in plain PyTorch, conditioned on tokens only (a `Drafter`).

The scheme follows vLLM's DSpark speculator (`vllm/v1/worker/gpu/spec_decode/dspark/`) and its
draft models (`qwen3_dspark.py`, K3's dense MLA `dspark_mla.py`), minus what a separate service
cannot have: the target's hidden states. Per request and `propose(k)`, greedy:

1. ONE forward pass over `[context tokens not yet cached (the last is the anchor)] + [k - 1 query
   slots holding the mask embedding]`, causal over the KV cache plus these rows. Real tokens' KV
   stays in the cache; the query slots' KV is dropped.
2. The hidden states at the anchor and the k - 1 slots -> final norm -> the target's LM head:
   base logits `[k, vocab]` (the anchor predicts the first draft, "anchor-as-first-prediction").
3. The sequential Markov head: `prev = anchor`; for i in 0..k-1:
   `d_i = argmax(base[i] + markov_w2 @ markov_w1[prev])`; `prev = d_i`
   (`DSparkMarkovHead` of `qwen3_dspark.py`, a rank-`markov_rank` transition bias).

Where this differs from vLLM: vLLM's draft attends to context KV projected from the target's hidden
states (`context_proj`) and its query block is non-causal; here the context is the drafter's own
encoding of the tokens and everything is causal, so the drafter is an ordinary small LM over the
context plus a parallel block. K3 DSpark tensors load by name (`layers.N.self_attn.q_a_proj.weight`,
..., `final_norm.weight`, `markov_head.markov_w{1,2}.weight`; `context_proj`, `context_norm` and
`confidence_head` are ignored), but weights trained for vLLM's conditioning would draft poorly here.

Attention is either DeepSeek-V3/K3 MLA (`attention_type="mla"`: cached as the normalized latent plus
the shared RoPE key, `kv_lora_rank + qk_rope_head_dim` floats per token and layer, attended with the
absorbed `kv_b_proj`, as vLLM's MLA decode does) or Llama GQA (`"gqa"`), which the embedded build
uses because it copies SmolLM2 layers as they are.

The embedded drafter (`build_embedded_dspark`) copies the final norm and
`EMBEDDED_TARGET_LAYER_IDS` of SmolLM2-135M-Instruct and shares its tied embedding / LM head: the
checkpoint does not store them (`shares_target_embedding` in its config.json), the service passes
the target's at load time (`shared=target_shared_tensors(target_dir)`), as vLLM aliases a K3
draft's. The Markov head is the drafter's own bigram prediction (the final hidden state for the
one-token context `[t]`) compressed to rank 64, the mask embedding is the mean token embedding.
Nothing is trained. On disk: 82 MB float32 (4 layers 57 MB, Markov head 25 MB).

Layer choice, measured with `python -m moonserve.pipeline.bench.acceptance --reference`
(`measure_layer_choices`): the 8 `MEASURE_PROMPTS` (4 chat, 4 copy/edit) under the chat template,
each extended by 48 target-greedy tokens (transformers, float32, argmax past EOS); a k = 4
proposal after every generated prefix that has 4 target tokens after it (8 x 45 = 360 proposals).
"mean" is the mean accepted length (leading drafts equal to the target's tokens, 0..4), d1..d4
the fraction of proposals whose drafts 1..i all matched; "no Markov" the same with the Markov head
left at zero; derive s: `derive_markov_head` wall time on this 2-core machine (varies 2x with load):

    layers              mean     d1     d2     d3     d4   no-Markov mean   derive s
    first 4 (chosen)   0.050  0.050  0.000  0.000  0.000            0.031       11.6
    first 8            0.056  0.056  0.000  0.000  0.000            0.050       18.7
    first 3 + last 3   0.025  0.025  0.000  0.000  0.000            0.011       12.4
    first 4 + last 4   0.017  0.017  0.000  0.000  0.000            0.000       18.4
    every 4th + last   0.042  0.042  0.000  0.000  0.000            0.050       21.0
    -- past the 8-layer budget, for reference --
    first 16           0.086  0.086  0.000  0.000  0.000            0.086       42.1
    first 24           0.317  0.306  0.011  0.000  0.000            0.331       63.9
    all 30             0.503  0.453  0.050  0.000  0.000            1.233       80.4
    ngram (2..5)       0.578  0.208  0.153  0.122  0.094

What the numbers say: untrained layer subsets are early exits through the final norm and LM head,
and up to 8 of 30 layers they mostly predict punctuation; no choice accepts a second draft. The
embedded build takes the first 4: first 8 is ahead by 2 hits in 360 (0.056 vs 0.050 mean accepted
length), which is noise, while 4 layers halve the layer weights and the build time (Markov derive
11.6 vs 18.7 s). The derived Markov head moves weak backbones by a few hits either way and hurts
a good one (all 30: 1.23 -> 0.50), because at the anchor it adds a bigram prediction to a
prediction that already saw the anchor. Prompt lookup beats every untrained choice; a useful
DSpark drafter needs trained weights (or at least a fitted early-exit head).

MXFP4: a checkpoint may ship linear weights as gpt-oss does, `X.weight_blocks` uint8
`[out, in // 32, 16]` + `X.weight_scales` uint8 `[out, in // 32]` instead of `X.weight`
(attention and MLP projections, the Markov head's `markov_w2`, an untied LM head); `load_model`
loads them with `moonserve.kernels.mxfp4.linear.load_weights`, so those linears run as `MXFP4Linear` (Triton
on GPU, decoded per matmul in torch on CPU). `quantize_drafter_checkpoint` writes such a copy.
Measured with `python -m moonserve.pipeline.bench.acceptance --mxfp4` (`measure_mxfp4`; same 360
proposals as above, 2-core CPU):

    drafter      MB    mean     d1     d2     d3     d4   ms/proposal
    float      81.8   0.050  0.050  0.000  0.000  0.000          36
    mxfp4      21.8   0.031  0.031  0.000  0.000  0.000         113
    mxfp4 vs float: identical drafts 0.283, first draft 0.633

The direct-cast weights are off by 12% relative RMS, the anchor's logits by 9%, and this untrained
early exit decides its first draft by near-ties (median top-1 margin 0.86 logits), so a third of
them flip; most flips come from `markov_w2` (quantizing only the layers keeps 0.86 of first drafts,
only `markov_w2` 0.65, on 168 of these proposals). On CPU the torch path decodes every weight on
every matmul, hence 3x slower; it is the GPU kernel that reads 4-bit weights.

Example:
    >>> config = DSparkConfig(hidden_size=32, vocab_size=100, num_hidden_layers=1,
    ...                       num_attention_heads=2, intermediate_size=64, attention_type="gqa",
    ...                       num_key_value_heads=1, head_dim=16, markov_rank=4)
    >>> state = DSparkDrafter(DSparkModel(config)).new_state("req-1")   # random weights
    >>> state.append([5, 6, 7])
    >>> len(state.propose(num_speculative_tokens=4))   # one block pass + 4 Markov steps
    4
    >>> state.num_cached_tokens                         # the query slots' KV is not kept
    3

    The embedded drafter: `DSparkDrafter.from_pretrained(build_embedded_dspark(lm_dir, out_dir),
    shared=target_shared_tensors(lm_dir))`; its MXFP4 copy:
    `quantize_drafter_checkpoint(drafter_dir, mxfp4_dir)`, loaded the same way.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moonserve.kernels.mxfp4.linear import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    MXFP4Linear,
    check_pair,
    load_weights,
    packed_weight_names,
    packed_weight_shape,
    quantize_linear_weights,
)
from moonserve.kernels.mxfp4.naive import BLOCK_SIZE, dequantize

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "moonserve_dspark"
ATTENTION_TYPES = ("mla", "gqa")
# Tensors of a K3 DSpark checkpoint a token-only drafter has no input for: the projection of the
# target's hidden states into the context (and its fused per-layer KV copy), and the training-time
# acceptance-probability head.
IGNORED_PREFIXES = ("context_proj.", "context_norm.", "context_kv_proj.", "confidence_head.")
# Measured by `measure_layer_choices`; see the table in the module docstring.
EMBEDDED_TARGET_LAYER_IDS = (0, 1, 2, 3)
EMBEDDED_MARKOV_RANK = 64
# Where a target checkpoint keeps its embedding (Llama / DeepSeek; Kimi-VL-style wrappers) and, when
# it is not tied to the embedding, its LM head.
TARGET_EMBEDDING_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
TARGET_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
SHARED_EMBEDDING_HINT = ("pass the target's embedding: DSparkDrafter.from_pretrained(path, "
                         "shared=target_shared_tensors(target_dir))")


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter's `config.json`; field names follow K3DSparkConfig / DeepseekV3Config.

    `attention_type="mla"` reads `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    `qk_rope_head_dim`, `v_head_dim`; `"gqa"` reads `num_key_value_heads` and `head_dim`.
    `mask_token_id`: the query slots' input is that token's embedding (vLLM's convention); None:
    a learned or derived `mask_embedding` tensor `[hidden_size]`.
    `target_layer_ids`: the target layers the drafter was built from (provenance only here).
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
    markov_rank: int = EMBEDDED_MARKOV_RANK
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] = ()
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
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    @classmethod
    def from_dict(cls, data: Mapping) -> DSparkConfig:
        """The fields above from a `config.json` dict; other keys (a K3 config also carries
        DeepseekV3's MoE and training settings) are ignored."""
        check_supported(data)
        names = {f.name for f in fields(cls)}
        values = {name: value for name, value in data.items() if name in names}
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

    def __init__(self, config: DSparkConfig, tie_word_embeddings: bool = True):
        super().__init__()
        self.config = config
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


class DSparkState:
    """One request's context and KV cache (a `DrafterState`); `append` only records tokens."""

    def __init__(self, model: DSparkModel, max_model_len: int | None = None):
        self.model = model
        self.max_model_len = max_model_len
        self._token_ids: list[int] = []
        self._cache = model.new_cache()

    @property
    def token_ids(self) -> Sequence[int]:
        return self._token_ids

    @property
    def num_cached_tokens(self) -> int:
        return self._cache.num_tokens

    def append(self, token_ids: Sequence[int]) -> None:
        self._token_ids.extend(int(t) for t in token_ids)

    def truncate(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        del self._token_ids[num_tokens:]
        self._cache.truncate(num_tokens)

    @torch.inference_mode()
    def propose(self, num_speculative_tokens: int) -> list[int]:
        """`num_speculative_tokens` greedy drafts from one block pass + the Markov head; fewer
        when `max_model_len` (or the drafter's `max_position_embeddings`) leaves less room,
        none for an empty context."""
        k = self._capped_k(num_speculative_tokens)
        if k <= 0:
            return []
        return self.model.markov_decode(self.block_logits(k), self._token_ids[-1])

    @torch.inference_mode()
    def block_logits(self, k: int) -> torch.Tensor:
        """Base logits at the anchor and `k - 1` query slots, `[k, vocab]`; caches the context."""
        num_tokens = len(self._token_ids)
        if num_tokens == 0 or k < 1:
            raise ValueError(f"a block needs a context and k >= 1, got {num_tokens} tokens, k={k}")
        # The anchor's hidden state is needed even when its KV is cached (a repeated propose).
        self._cache.truncate(num_tokens - 1)
        new_ids = self._token_ids[self._cache.num_tokens :]
        hidden = self.model(self.model.embed_block(new_ids, k - 1), self._cache)
        self._cache.truncate(num_tokens)  # keep the real tokens' KV, drop the query slots'
        return self.model.compute_logits(hidden[len(new_ids) - 1 :])

    def _capped_k(self, k: int) -> int:
        num_tokens = len(self._token_ids)
        if num_tokens == 0:
            return 0
        # The last query slot sits at position num_tokens + k - 2.
        k = min(k, self.model.config.max_position_embeddings - num_tokens + 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - num_tokens)
        return k


class DSparkDrafter:
    """DSpark block `Drafter`: one model shared by every request's `DSparkState`.

    Example:
        >>> import tempfile
        >>> drafter = DSparkDrafter(DSparkModel(DSparkConfig(
        ...     hidden_size=32, vocab_size=100, num_hidden_layers=1, num_attention_heads=2,
        ...     intermediate_size=64, attention_type="gqa", num_key_value_heads=1, head_dim=16)))
        >>> with tempfile.TemporaryDirectory() as path:      # config.json + model.safetensors
        ...     drafter.save_pretrained(path)
        ...     loaded = DSparkDrafter.from_pretrained(path, max_model_len=5)
        >>> state = loaded.new_state("req-1")
        >>> state.append([1, 2, 3])
        >>> len(state.propose(4))   # capped by max_model_len - num_tokens
        2
    """

    name = "dspark"

    def __init__(self, model: DSparkModel, max_model_len: int | None = None):
        self.model = model.eval().requires_grad_(False)
        self.max_model_len = max_model_len

    def new_state(self, request_id: str) -> DSparkState:
        return DSparkState(self.model, self.max_model_len)

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        shared: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> DSparkDrafter:
        """Load `path/config.json` and `path/*.safetensors`; linear weights may be MXFP4
        (`X.weight_blocks` + `X.weight_scales`, see `load_model`).

        `shared`: the target's `embed_tokens.weight` (and `lm_head.weight` when untied), which
        the checkpoint omits when its config says `shares_target_embedding` (the embedded build)
        and which K3 DSpark drafts omit too (vLLM aliases the target's at load time); read them
        with `target_shared_tensors(target_dir)`. A tensor the checkpoint has wins over `shared`.
        `device`: where the weights and caches live (the tests run on CPU only).
        """
        path = Path(path)
        config = DSparkConfig.from_json(path / CONFIG_FILE)
        tensors = {**(shared or {}), **read_safetensors(path)}
        model = load_model(config, tensors, source=str(path), dtype=dtype, device=device)
        return cls(model, max_model_len)

    def save_pretrained(self, path: Path | str) -> None:
        save_model(self.model, Path(path))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def target_shared_tensors(lm_dir: Path | str) -> dict[str, torch.Tensor]:
    """The target's tensors a drafter shares: `embed_tokens.weight` `[vocab, hidden]`, plus
    `lm_head.weight` `[vocab, hidden]` when the checkpoint has an LM head of its own (untied);
    read alone with `safe_open` (one file or a sharded `model.safetensors.index.json`), in the
    checkpoint's dtype.

    >>> lm_dir = prepare_language_model()  # doctest: +SKIP
    >>> drafter = DSparkDrafter.from_pretrained(drafter_dir,  # doctest: +SKIP
    ...                                         shared=target_shared_tensors(lm_dir))
    """
    lm_dir = Path(lm_dir)
    files = target_tensor_files(lm_dir)
    embedding = next((name for name in TARGET_EMBEDDING_NAMES if name in files), None)
    if embedding is None:
        raise ValueError(f"{lm_dir}: no target embedding to share: none of "
                         f"{', '.join(TARGET_EMBEDDING_NAMES)} in its safetensors")
    shared = {"embed_tokens.weight": embedding}
    lm_head = next((name for name in TARGET_LM_HEAD_NAMES if name in files), None)
    if lm_head is not None:
        shared["lm_head.weight"] = lm_head
    return {name: read_tensor(files[src], src) for name, src in shared.items()}


def target_tensor_files(lm_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = lm_dir / f"{WEIGHTS_FILE}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: lm_dir / file for name, file in weight_map.items()}
    files = sorted(lm_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{lm_dir}: no *.safetensors files")
    located: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            located.update(dict.fromkeys(f.keys(), file))
    return located


def read_tensor(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def load_model(
    config: DSparkConfig,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DSparkModel:
    """Build a `DSparkModel` from named tensors, checking names and shapes against `config`.

    A linear weight `X.weight` may come as MXFP4, gpt-oss style: `X.weight_blocks` uint8
    `[out, in // 32, 16]` + `X.weight_scales` uint8 (or float8_e8m0fnu) `[out, in // 32]`; that
    linear then runs as an `MXFP4Linear` (`moonserve.kernels.mxfp4.linear.load_weights`; packed tensors keep
    their dtype, float ones are cast to `dtype`).
    """
    tensors = {name: t for name, t in tensors.items() if not name.startswith(IGNORED_PREFIXES)}
    check_embedding_present(config, tensors, source)
    untied = any(name in tensors for name in ("lm_head.weight", "lm_head.weight" + BLOCKS_SUFFIX))
    with torch.device("meta"):
        model = DSparkModel(config, tie_word_embeddings=not untied)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    check_tensor_names(expected, logical_shapes(model, tensors, source), source)
    state = {name: (t.to(device) if name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))
                    else t.to(device, dtype)).contiguous() for name, t in tensors.items()}
    load_weights(model, state, strict=True, assign=True)
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
    shapes = {name: tuple(t.shape) for name, t in tensors.items()
              if not name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))}
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


def dspark_from_llama(
    lm_dir: Path,
    target_layer_ids: Sequence[int] = EMBEDDED_TARGET_LAYER_IDS,
    markov_rank: int = EMBEDDED_MARKOV_RANK,
) -> DSparkModel:
    """A gqa drafter over a Llama checkpoint's embedding and LM head (`target_shared_tensors`;
    `shares_target_embedding`, so saving it stores neither) holding copies of its final norm and
    layers `target_layer_ids`; mask embedding = mean token embedding; Markov head zero."""
    from safetensors import safe_open

    lm_dir = Path(lm_dir)
    data = json.loads((lm_dir / CONFIG_FILE).read_text())
    config = llama_dspark_config(data, tuple(target_layer_ids), markov_rank)
    mapping = {"final_norm.weight": "model.norm.weight"}
    for i, src in enumerate(config.target_layer_ids):
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            mapping[f"layers.{i}.{part}.weight"] = f"model.layers.{src}.{part}.weight"
    tensors = {name: t.float() for name, t in target_shared_tensors(lm_dir).items()}
    with safe_open(str(lm_dir / WEIGHTS_FILE), framework="pt") as f:
        available = set(f.keys())
        for name, src in mapping.items():
            if src not in available:
                raise ValueError(f"{lm_dir / WEIGHTS_FILE}: missing tensor {src}")
            tensors[name] = f.get_tensor(src).float()
    vocab = config.vocab_size
    tensors["mask_embedding"] = tensors["embed_tokens.weight"].mean(dim=0)
    tensors["markov_head.markov_w1.weight"] = torch.zeros(vocab, markov_rank)
    tensors["markov_head.markov_w2.weight"] = torch.zeros(vocab, markov_rank)
    return load_model(config, tensors, source=str(lm_dir))


def llama_dspark_config(data: Mapping, target_layer_ids: tuple[int, ...],
                        markov_rank: int) -> DSparkConfig:
    """The gqa `DSparkConfig` of a drafter made of `target_layer_ids` of a Llama `config.json`,
    sharing the target's embedding and LM head."""
    check_supported(data)
    num_target_layers = data["num_hidden_layers"]
    if not target_layer_ids or any(not 0 <= i < num_target_layers for i in target_layer_ids):
        raise ValueError(f"target_layer_ids must be a non-empty selection of the target's "
                         f"{num_target_layers} layers, got {target_layer_ids}")
    rope = data.get("rope_parameters") or {}
    return DSparkConfig(
        hidden_size=data["hidden_size"], vocab_size=data["vocab_size"],
        num_hidden_layers=len(target_layer_ids),
        num_attention_heads=data["num_attention_heads"],
        num_key_value_heads=data.get("num_key_value_heads", data["num_attention_heads"]),
        head_dim=data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
        intermediate_size=data["intermediate_size"], rms_norm_eps=data["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", data.get("rope_theta", 10000.0)),
        attention_type="gqa", markov_rank=markov_rank, target_layer_ids=target_layer_ids,
        max_position_embeddings=data["max_position_embeddings"], shares_target_embedding=True,
    )


@torch.inference_mode()
def derive_markov_head(model: DSparkModel, batch_size: int = 2048) -> None:
    """Set the Markov head to the drafter's own bigram prediction, compressed to rank r.

    H[t] = `single_token_hidden([t])` `[vocab, hidden]`; U = the top-r right singular vectors of
    H (principal directions of the uncentered states, so the mean direction is kept)
    `[hidden, r]`; markov_w1 = H U and markov_w2 = W_lm U, so
    `markov_w2 @ markov_w1[t] = W_lm U U^T H[t] ~ W_lm H[t]`, the logits after the context `[t]`.
    """
    vocab, rank = model.config.vocab_size, model.config.markov_rank
    device = model.embed_tokens.weight.device
    hidden = torch.cat([model.single_token_hidden(ids)
                        for ids in torch.arange(vocab, device=device).split(batch_size)])
    gram = (hidden.T.double() @ hidden.double())  # [hidden, hidden]
    _, eigenvectors = torch.linalg.eigh(gram)  # ascending eigenvalues
    basis = eigenvectors[:, -rank:].flip(-1).to(hidden.dtype)  # [hidden, r]
    head = model.markov_head
    head.markov_w1.weight = nn.Parameter(hidden @ basis, requires_grad=False)
    head.markov_w2.weight = nn.Parameter(model.lm_head_weight @ basis, requires_grad=False)


def build_embedded_dspark(
    lm_dir: Path,
    out_dir: Path,
    target_layer_ids: tuple[int, ...] = EMBEDDED_TARGET_LAYER_IDS,
    markov_rank: int = EMBEDDED_MARKOV_RANK,
) -> Path:
    """Build the drafter from the embedded target into `out_dir` (atomically); returns it.

    The checkpoint holds the layers, final norm, mask embedding and Markov head, not the
    embedding and LM head (`shares_target_embedding`): load it with the target's.

    Example:
        >>> from moonserve.pipeline.prepare.language_model import prepare_language_model
        >>> lm_dir = prepare_language_model()  # doctest: +SKIP
        >>> path = build_embedded_dspark(lm_dir, Path("/tmp/dspark"))  # doctest: +SKIP
        >>> drafter = DSparkDrafter.from_pretrained(  # doctest: +SKIP
        ...     path, shared=target_shared_tensors(lm_dir))
        >>> drafter.model.config.target_layer_ids  # doctest: +SKIP
        (0, 1, 2, 3)
    """
    model = dspark_from_llama(lm_dir, target_layer_ids, markov_rank)
    derive_markov_head(model)
    return write_atomically(Path(out_dir), lambda staging: save_model(model, staging))


def quantize_drafter_checkpoint(src_dir: Path | str, out_dir: Path | str) -> Path:
    """Write an MXFP4 copy of the drafter checkpoint `src_dir` into `out_dir` (atomically).

    Packed (`X.weight_blocks` + `X.weight_scales`, `moonserve.kernels.mxfp4.linear.quantize_linear_weights`):
    the linears of the decoder layers and the Markov head's `markov_w2`, where their in-dim is a
    multiple of 32. Kept as they are: norms, embeddings (`markov_w1` too), the mask embedding, an
    LM head the checkpoint has of its own (gpt-oss also ships its LM head unquantized), and the
    tensors a token-only drafter ignores. `config.json` is copied unchanged: loading tells MXFP4
    weights by their names.

    >>> path = quantize_drafter_checkpoint(drafter_dir, "/tmp/dspark-mxfp4")  # doctest: +SKIP
    >>> DSparkDrafter.from_pretrained(path, shared=target_shared_tensors(lm_dir))  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    src_dir = Path(src_dir)
    names = mxfp4_weight_names(DSparkConfig.from_json(src_dir / CONFIG_FILE))
    packed = quantize_linear_weights(read_safetensors(src_dir), lambda name, _: name in names)

    def write(staging: Path) -> None:
        shutil.copyfile(src_dir / CONFIG_FILE, staging / CONFIG_FILE)
        save_file(packed, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})

    return write_atomically(Path(out_dir), write)


def mxfp4_weight_names(config: DSparkConfig) -> frozenset[str]:
    """The `X.weight`s `quantize_drafter_checkpoint` packs (see there)."""
    with torch.device("meta"):
        model = DSparkModel(config)  # tied: an LM head of the checkpoint's own stays float
    return frozenset(f"{name}.weight" for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and m.in_features % BLOCK_SIZE == 0)


def write_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging)` in a sibling directory, then move it to `out_dir`; returns `out_dir`."""
    from moonserve.pipeline.prepare.language_model import replace_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write(staging)
        # mkdtemp makes the directory 0700 and safetensors its file 0600; the drafter is shared
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
