"""Random weights for the tiny Kimi K3 and K3 DSpark checkpoints of the GPU smoke run.

`moonserve.pipeline.synthetic_checkpoints.k3` writes the configs and tokenizer; this module adds
`model.safetensors` beside them, for `python -m moonserve.pipeline.bench.gpu_smoke`. `SMOKE_DIMS`
is small enough to load in seconds and takes every code path of vLLM's NVIDIA
`KimiK3ForConditionalGeneration` (KDA and MLA layers, a dense layer and MoE layers with a shared
expert, the MoonViT tower and its projector). The K3 tensors are exactly those
`pipeline/capacity/kimi_k3_layout.py` lists for the config at TP=1, under vLLM's names (K3's weight
mapper leaves them as they are).

Storage: every weight in bfloat16 and no `quantization_config`, so vLLM builds unquantized layers
(`UnquantizedLinearMethod`, the Triton fused-MoE path) that load `.weight` tensors as they are. The
shipped checkpoint's MXFP4 experts would route the MoE through compressed-tensors MXFP4 kernels
whose tiles a 256-wide expert may not fill; `moonserve check-checkpoint` covers the real MXFP4
pairs from their headers. Router bias, `A_log` and `dt_bias` are float32, as vLLM registers them.

The DSpark draft (`K3DSparkModel`, vllm/models/kimi_k3/nvidia/dspark_mla.py) holds what
`K3DSparkForCausalLM.load_weights` reads: `context_proj`, `context_norm`, dense MLA + MLP
`layers.{i}`, `final_norm` and the Markov head; embedding and LM head are the target's (its mapper
drops them), and `context_kv_proj` is filled from each layer's `kv_a_proj_with_mqa`.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> k3, draft = write_smoke_configs(root / "k3", root / "dspark")
    >>> tensors = write_random_weights(root / "k3")
    >>> tensors["language_model.model.embed_tokens.weight"].shape
    torch.Size([512, 1024])
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moonserve.pipeline.capacity.kimi_k3_layout import KimiCheckpointConfig, expected_tensors
from moonserve.pipeline.models.weights import WEIGHTS_FILE
from moonserve.pipeline.synthetic_checkpoints.k3 import K3Dims, write_dspark_config, write_k3_config

FLOAT32_SUFFIXES = ("e_score_correction_bias", "A_log", "dt_bias")  # fp32 parameters in vLLM
# With `constant_logits`, zero: the target's LM head (the draft shares it) and the draft's Markov
# logit-bias head, so every logit is 0 and greedy target and greedy draft both pick token 0: every
# draft is accepted, which lets the smoke run assert acceptance on random weights.
LOGIT_TENSORS = ("lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
# K3Dims() resized so vLLM's NVIDIA kernels see production geometry: MLA latent 512 + rope 64 with
# 128-wide nope/v heads (the FlashMLA / FlashAttention-MLA shapes), KDA head_dim 128, 16 MLA heads.
SMOKE_DIMS = replace(K3Dims(), hidden_size=1024, num_attention_heads=16, q_lora_rank=512,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     kda_num_heads=8, kda_head_dim=128, intermediate_size=2048, num_experts=16,
                     moe_intermediate_size=256)


def write_smoke_configs(k3_dir: Path, dspark_dir: Path, dims: K3Dims = SMOKE_DIMS,
                        draft_layers: int = 2) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json + tokenizer of both checkpoints (`k3.py`); returns both configs."""
    write_k3_config(k3_dir, dims)
    write_dspark_config(dspark_dir, dims, num_hidden_layers=draft_layers)
    return (json.loads((k3_dir / "config.json").read_text()),
            json.loads((dspark_dir / "config.json").read_text()))


def dspark_expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor `K3DSparkForCausalLM.load_weights` reads."""
    c = config
    h, heads, q_lora, kv = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], \
        c["kv_lora_rank"]
    nope, rope, v, inter = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], \
        c["intermediate_size"]
    shapes = {"context_proj.weight": (h, c["target_hidden_size"] * c["num_target_layers"]),
              "context_norm.weight": (h,), "final_norm.weight": (h,),
              "markov_head.markov_w1.weight": (c["vocab_size"], c["markov_rank"]),
              "markov_head.markov_w2.weight": (c["draft_vocab_size"], c["markov_rank"])}
    for i in range(c["num_hidden_layers"]):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes |= {f"{a}q_a_proj.weight": (q_lora, h), f"{a}q_a_layernorm.weight": (q_lora,),
                   f"{a}q_b_proj.weight": (heads * (nope + rope), q_lora),
                   f"{a}kv_a_proj_with_mqa.weight": (kv + rope, h),
                   f"{a}kv_a_layernorm.weight": (kv,),
                   f"{a}kv_b_proj.weight": (heads * (nope + v), kv),
                   f"{a}o_proj.weight": (h, heads * v),
                   f"{m}gate_proj.weight": (inter, h), f"{m}up_proj.weight": (inter, h),
                   f"{m}down_proj.weight": (h, inter),
                   f"layers.{i}.input_layernorm.weight": (h,),
                   f"layers.{i}.post_attention_layernorm.weight": (h,)}
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Values that keep a forward pass finite: norms 1, A_log log(1..16), weights N(0, 0.02)."""
    if name.endswith("norm.weight") or ".norm0." in name or ".norm1." in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=generator).log()
    values = torch.randn(shape, generator=generator) * 0.02
    return values if name.endswith(FLOAT32_SUFFIXES) else values.to(torch.bfloat16)


def random_k3_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor kimi_k3_layout expects for `config` at TP=1, random, under vLLM's names."""
    generator = torch.Generator().manual_seed(seed)
    layout = expected_tensors(KimiCheckpointConfig.from_dict(config), tensor_parallel_size=1)
    return {t.name: random_tensor(t.name, t.shape, generator) for t in layout}


def random_dspark_tensors(config: dict[str, Any], seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, shape, generator)
            for name, shape in dspark_expected_tensors(config).items()}


def write_random_weights(directory: Path, seed: int = 0,
                         constant_logits: bool = False) -> dict[str, torch.Tensor]:
    """model.safetensors beside the directory's config.json (a kimi_k3 or k3_dspark config);
    `constant_logits`: the logit tensors (`LOGIT_TENSORS`) zero."""
    config = json.loads((directory / "config.json").read_text())
    if config.get("model_type") == "k3_dspark":
        tensors = random_dspark_tensors(config, seed)
    else:
        tensors = random_k3_tensors(config, seed)
    if constant_logits:
        tensors = {name: torch.zeros_like(t) if name.endswith(LOGIT_TENSORS) else t
                   for name, t in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return tensors
