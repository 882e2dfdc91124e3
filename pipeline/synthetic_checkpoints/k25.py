"""A tiny Kimi-K2.5 checkpoint (`KimiK25ForConditionalGeneration`) with random weights.

What vLLM's CPU build loads and runs end to end in seconds: the MoonViT-3D tower, the patch-merger
projector and a DeepSeek-V3 (MLA + MoE) language model, so tests can exercise the encoder/LM split
(the encoder-cache transfer of `moonserve.pipeline.engine.ec_connector`) with real encoder outputs.
Text `kv_lora_rank` 512 + `qk_rope_head_dim` 64 because vLLM's CPU MLA backend supports only head
dim 576; vLLM forces prefix caching off for any MLA model on CPU.

API (all that other modules should use):

- `K25Dims`: the architecture sizes (hidden 256, 2 layers: 1 dense + 1 MoE with 8 experts; vision
  hidden 128, 2 layers). Change any field with `dataclasses.replace`.
- `k25_tensor_shapes(dims) -> {name: shape}`: every tensor vLLM's loader reads, under the
  checkpoint's names (those of the published Kimi-K2.5 checkpoint; the source is
  `KimiK25ForConditionalGeneration.hf_to_vllm_mapper` and `load_weights` in
  vllm/model_executor/models/kimi_k25.py, `DeepseekV2ForCausalLM.load_weights` in deepseek_v2.py
  for the unfused q_a/kv_a, gate/up and per-expert names, and the module names of kimi_k25_vit.py,
  whose tower has no loader of its own).
- `write_k25_checkpoint(dir, seed=0, dims=K25Dims()) -> Path`: config.json, preprocessor_config.json
  (`media_proc_cfg`), the tokenizer of `k3.write_tokenizer` and `model.safetensors`
  (norms 1, their biases 0, everything else N(0, 0.02); bfloat16, the router bias float32).
- `SERVE_ENGINE`, `serve_vision(store)`: how moonserve serves it (`moonserve bench overhead
  --engine k25`, tests/engines): the `language_model.engine` and `vision` settings.

Example:
    >>> import tempfile
    >>> d = write_k25_checkpoint(Path(tempfile.mkdtemp()) / "k25")
    >>> from safetensors import safe_open
    >>> with safe_open(d / "model.safetensors", "pt") as f:
    ...     f.get_slice("mm_projector.proj.0.weight").get_shape()
    [512, 512]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from moonserve.pipeline.models.weights import WEIGHTS_FILE
from moonserve.pipeline.synthetic_checkpoints.k3 import token_id, write_tokenizer

# The placeholder of one image in a prompt; vLLM's processor expands the pad to one per token.
IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


@dataclass(frozen=True)
class K25Dims:
    """Sizes of a K2.5 checkpoint; field names are the config.json keys."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 2
    first_k_dense_replace: int = 1  # layers below this are dense, the rest MoE
    intermediate_size: int = 512
    num_attention_heads: int = 4
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    q_lora_rank: int = 128
    kv_lora_rank: int = 512  # + qk_rope_head_dim = 576, the CPU MLA head dim
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    vt_hidden_size: int = 128
    vt_num_hidden_layers: int = 2
    vt_num_attention_heads: int = 4
    vt_intermediate_size: int = 256
    patch_size: int = 14
    pos_emb_size: int = 64  # the tower's learned 2D position grid is pos_emb_size^2
    merge_kernel_size: int = 2

    def text_config(self) -> dict:
        """`text_config` of config.json (transformers' DeepseekV3Config)."""
        return {
            "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": self.n_shared_experts, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "routed_scaling_factor": 1.0,
            "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1, "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim, "v_head_dim": self.v_head_dim,
            "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
            "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
            "bos_token_id": token_id("[BOS]"), "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("[PAD]"), "torch_dtype": "bfloat16",
        }

    def vision_config(self) -> dict:
        """`vision_config` of config.json (vLLM's Kimi_K25VisionConfig)."""
        return {
            "model_type": "kimi_k25_vision", "patch_size": self.patch_size,
            "pos_emb_height": self.pos_emb_size, "pos_emb_width": self.pos_emb_size,
            "pos_emb_time": 4, "num_attention_heads": self.vt_num_attention_heads,
            "num_hidden_layers": self.vt_num_hidden_layers, "hidden_size": self.vt_hidden_size,
            "intermediate_size": self.vt_intermediate_size, "hidden_act": "gelu_pytorch_tanh",
            "merge_kernel_size": [self.merge_kernel_size, self.merge_kernel_size],
        }


def k25_config(dims: K25Dims) -> dict:
    """config.json: `model_type: kimi_k25`, media token ids from `write_tokenizer`'s vocabulary."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": dims.text_config(), "vision_config": dims.vision_config(),
        "projection_hidden_size": dims.vt_hidden_size,
        "image_token_id": token_id("<|media_pad|>"),
        "video_token_id": token_id("<|kimi_image_placeholder|>"),
        "vision_start_token_id": token_id("<|media_begin|>"),
        "vision_end_token_id": token_id("<|media_end|>"),
        "use_unified_vision_chunk": True, "tie_word_embeddings": False,
        "pad_token_id": token_id("[PAD]"), "torch_dtype": "bfloat16",
    }


def preprocessor_config(dims: K25Dims) -> dict:
    """preprocessor_config.json, read by vLLM's KimiK25FusedVisionProcessor."""
    return {"media_proc_cfg": {
        "patch_size": dims.patch_size, "merge_kernel_size": dims.merge_kernel_size,
        "temporal_merge_kernel_size": 4, "in_patch_limit": 1024,
        "in_patch_limit_each_frame": 1024, "in_patch_limit_video": None,
        "patch_limit_on_one_side": dims.pos_emb_size, "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}


# The engine arguments moonserve serves the checkpoint with (vLLM runs MLA with prefix caching off
# on a CPU).
SERVE_ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 4,
                "max_num_batched_tokens": 2048, "enable_prompt_embeds": False}


def serve_vision(store: Path, dims: K25Dims = K25Dims()) -> dict:
    """The app's `vision` for the checkpoint: images handed to its engine (the encoder's outputs
    in `store`), preprocessed as its media_proc_cfg says."""
    media = preprocessor_config(dims)["media_proc_cfg"]
    return {"handover": "encoder_cache", "image_placeholder": "<|media_pad|>",
            "preprocessor": {k: media[k] for k in ("in_patch_limit", "patch_limit_on_one_side")},
            "encoder": {"store": str(store), "max_batch_size": 2}}


def vision_shapes(d: K25Dims) -> dict[str, tuple[int, ...]]:
    """MoonViT-3D tower + projector (its proj.0 / proj.2 are vLLM's linear_1 / linear_2)."""
    h, inter, merged = d.vt_hidden_size, d.vt_intermediate_size, \
        d.vt_hidden_size * d.merge_kernel_size ** 2
    shapes = {"vision_tower.patch_embed.proj.weight": (h, 3, d.patch_size, d.patch_size),
              "vision_tower.patch_embed.proj.bias": (h,),
              "vision_tower.patch_embed.pos_emb.weight": (d.pos_emb_size, d.pos_emb_size, h),
              "vision_tower.encoder.final_layernorm.weight": (h,),
              "vision_tower.encoder.final_layernorm.bias": (h,),
              "mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
              "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
              "mm_projector.proj.2.weight": (d.hidden_size, merged),
              "mm_projector.proj.2.bias": (d.hidden_size,)}
    for i in range(d.vt_num_hidden_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes |= {f"{b}norm0.weight": (h,), f"{b}norm0.bias": (h,), f"{b}norm1.weight": (h,),
                   f"{b}norm1.bias": (h,), f"{b}wqkv.weight": (3 * h, h), f"{b}wqkv.bias": (3 * h,),
                   f"{b}wo.weight": (h, h), f"{b}wo.bias": (h,),
                   f"{b}mlp.fc0.weight": (inter, h), f"{b}mlp.fc0.bias": (inter,),
                   f"{b}mlp.fc1.weight": (h, inter), f"{b}mlp.fc1.bias": (h,)}
    return shapes


def attention_shapes(d: K25Dims, prefix: str) -> dict[str, tuple[int, ...]]:
    """One MLA block: q/kv low-rank projections, as DeepseekV2's loader reads them unfused."""
    heads, h = d.num_attention_heads, d.hidden_size
    return {f"{prefix}q_a_proj.weight": (d.q_lora_rank, h),
            f"{prefix}q_a_layernorm.weight": (d.q_lora_rank,),
            f"{prefix}q_b_proj.weight": (heads * (d.qk_nope_head_dim + d.qk_rope_head_dim),
                                         d.q_lora_rank),
            f"{prefix}kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.qk_rope_head_dim, h),
            f"{prefix}kv_a_layernorm.weight": (d.kv_lora_rank,),
            f"{prefix}kv_b_proj.weight": (heads * (d.qk_nope_head_dim + d.v_head_dim),
                                          d.kv_lora_rank),
            f"{prefix}o_proj.weight": (h, heads * d.v_head_dim)}


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (inter, hidden),
            f"{prefix}up_proj.weight": (inter, hidden),
            f"{prefix}down_proj.weight": (hidden, inter)}


def moe_shapes(d: K25Dims, prefix: str) -> dict[str, tuple[int, ...]]:
    """Sigmoid router + correction bias, shared experts as one MLP, routed experts one by one."""
    shapes = {f"{prefix}gate.weight": (d.n_routed_experts, d.hidden_size),
              f"{prefix}gate.e_score_correction_bias": (d.n_routed_experts,)}
    shapes |= mlp_shapes(f"{prefix}shared_experts.", d.hidden_size,
                         d.moe_intermediate_size * d.n_shared_experts)
    for e in range(d.n_routed_experts):
        shapes |= mlp_shapes(f"{prefix}experts.{e}.", d.hidden_size, d.moe_intermediate_size)
    return shapes


def language_shapes(d: K25Dims) -> dict[str, tuple[int, ...]]:
    lm, h = "language_model.", d.hidden_size
    shapes = {f"{lm}model.embed_tokens.weight": (d.vocab_size, h), f"{lm}model.norm.weight": (h,),
              f"{lm}lm_head.weight": (d.vocab_size, h)}
    for i in range(d.num_hidden_layers):
        layer = f"{lm}model.layers.{i}."
        shapes |= {f"{layer}input_layernorm.weight": (h,),
                   f"{layer}post_attention_layernorm.weight": (h,)}
        shapes |= attention_shapes(d, f"{layer}self_attn.")
        if i < d.first_k_dense_replace:
            shapes |= mlp_shapes(f"{layer}mlp.", h, d.intermediate_size)
        else:
            shapes |= moe_shapes(d, f"{layer}mlp.")
    return shapes


def k25_tensor_shapes(dims: K25Dims = K25Dims()) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor vLLM's KimiK25ForConditionalGeneration loads."""
    return vision_shapes(dims) | language_shapes(dims)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights 1 and their biases 0 (so layers pass activations on), else N(0, 0.02)."""
    if "norm" in name.split(".")[-2]:  # e.g. q_a_layernorm.weight, norm0.bias
        fill = 1.0 if name.endswith(".weight") else 0.0
        return torch.full(shape, fill, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=generator) * 0.02
    # vLLM registers the router's correction bias as a float32 parameter.
    return values if name.endswith("e_score_correction_bias") else values.to(torch.bfloat16)


def write_k25_checkpoint(directory: str | Path, seed: int = 0, dims: K25Dims = K25Dims()) -> Path:
    """Write a loadable K2.5 checkpoint directory (configs, tokenizer, random weights)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "config.json", k25_config(dims))
    _write_json(directory / "preprocessor_config.json", preprocessor_config(dims))
    write_tokenizer(directory, dims.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, shape, generator)
               for name, shape in k25_tensor_shapes(dims).items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
