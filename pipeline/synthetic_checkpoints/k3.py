"""Synthetic Kimi K3 and K3 DSpark checkpoint directories: configs and tokenizer, no weights.

What vLLM reads before it touches a tensor, so vLLM's own config objects (`ModelConfig`,
`SpeculativeConfig`, `VllmConfig`) can be built from a production YAML on a machine without the
real checkpoint, and a GPU smoke test can add random weights beside these files.

API (all that other modules should use):

- `K3Dims`: the architecture sizes; `K3Dims()` is tiny (hidden 256, 4 layers: 3 KDA + 1 MLA,
  8 experts, 8 attention heads so TP 8 divides them). Change any field with `dataclasses.replace`.
- `write_k3_config(dir, dims=K3Dims()) -> Path`: writes `config.json` (`model_type: kimi_k3`,
  `architectures: [KimiK3ForConditionalGeneration]`, text config as vLLM's `KimiLinearConfig`,
  vision config as `KimiK3VisionConfig`), `preprocessor_config.json` (`media_proc_cfg`, read by
  vLLM's `KimiK25FusedVisionProcessor`) and the tokenizer files (`write_tokenizer`); returns `dir`.
- `write_dspark_config(dir, dims=K3Dims(), *, num_hidden_layers=1, target_layer_ids=None,
  block_size=7) -> Path`: writes `config.json` of a dense MLA DSpark draft
  (`model_type: k3_dspark`, `architectures: [K3DSparkModel]`, vLLM's `K3DSparkConfig`) sized to
  the target's `dims`; returns `dir`.
- `write_tokenizer(dir, vocab_size) -> Path`: a byte-level BPE tokenizer (256 byte tokens, no
  merges, so any text encodes) plus K3's special tokens (`SPECIAL_TOKENS`: chat roles, the
  `<|open|>`/`<|close|>`/`<|sep|>` tool and reasoning markers, the media tokens), a chat template
  and `tokenizer_config.json`, loadable by `transformers.AutoTokenizer` without remote code.

Field meanings follow `vllm/transformers_utils/configs/{kimi_k3,kimi_linear,k3_dspark}.py`; the
tensors a loader then expects for these dims: `moonserve.pipeline.capacity.kimi_k3_layout`.

Example:
    >>> import tempfile, json
    >>> d = write_k3_config(Path(tempfile.mkdtemp()) / "k3")
    >>> json.loads((d / "config.json").read_text())["architectures"]
    ['KimiK3ForConditionalGeneration']
    >>> s = write_dspark_config(Path(tempfile.mkdtemp()) / "k3-dspark")
    >>> json.loads((s / "config.json").read_text())["model_type"]
    'k3_dspark'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# K3's special tokens, in id order after the 256 byte tokens. `<|media_pad|>` is the image
# embedding slot (mm_preprocess resolves its id from the tokenizer); `<|kimi_image_placeholder|>`
# is the one-per-image token K3's processor expands; `<|open|>`/`<|close|>`/`<|sep|>` are the
# markers of vllm/tool_parsers/kimi_k3_tool_parser.py and reasoning/kimi_k3_reasoning_parser.py.
SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "[UNK]", "[PAD]",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
    "<|open|>", "<|close|>", "<|sep|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|kimi_image_placeholder|>",
)
NUM_BYTE_TOKENS = 256

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ '<|kimi_image_placeholder|>' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)


@dataclass(frozen=True)
class K3Dims:
    """Sizes of a K3 checkpoint; field names are the config.json keys (KimiLinearConfig's)."""

    vocab_size: int = 512  # >= 256 bytes + the special tokens; a multiple of 64
    hidden_size: int = 256
    num_hidden_layers: int = 4
    kda_layers: tuple[int, ...] = (1, 2, 3)  # 1-based, as linear_attn_config has them
    num_attention_heads: int = 8
    intermediate_size: int = 512  # dense MLP (layers below first_k_dense_replace)
    first_k_dense_replace: int = 1
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 128
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    kda_num_heads: int = 8
    kda_head_dim: int = 32
    kda_short_conv_kernel_size: int = 4
    max_position_embeddings: int = 1 << 20
    rope_theta: float = 50000.0
    # Vision tower (KimiK3VisionConfig): heads divide the hidden size; merge 2x2 as shipped.
    vt_hidden_size: int = 128
    vt_num_hidden_layers: int = 2
    vt_num_attention_heads: int = 4
    vt_intermediate_size: int = 256
    vt_qkv_hidden_size: int = 192
    patch_size: int = 14

    def __post_init__(self):
        if self.vocab_size < NUM_BYTE_TOKENS + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size {self.vocab_size} is below the tokenizer's "
                             f"{NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)} tokens")
        if any(not 1 <= i <= self.num_hidden_layers for i in self.kda_layers):
            raise ValueError(f"kda_layers {self.kda_layers} must be in 1..{self.num_hidden_layers}")

    def full_attn_layers(self) -> list[int]:
        """1-based MLA layers: every layer that is not KDA."""
        return [i for i in range(1, self.num_hidden_layers + 1) if i not in self.kda_layers]

    def text_config(self) -> dict:
        """`text_config` of config.json (vLLM's KimiLinearConfig)."""
        return {
            "model_type": "kimi_linear", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "first_k_dense_replace": self.first_k_dense_replace, "moe_layer_freq": 1,
            "num_experts": self.num_experts, "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            # vLLM's K3 decoder layer asserts NoPE MLA ("Kimi-K3 MLA is NoPE-only"), and only a
            # full-rank KDA gate builds K3's delta attention (else Kimi-Linear's layer).
            "mla_use_nope": True, "mla_use_output_gate": False,
            "num_nextn_predict_layers": 0,
            "linear_attn_config": {
                "kda_layers": list(self.kda_layers), "full_attn_layers": self.full_attn_layers(),
                "num_heads": self.kda_num_heads, "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_short_conv_kernel_size,
                "use_full_rank_gate": True},
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "bos_token_id": token_id("[BOS]"), "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("[PAD]"), "torch_dtype": "bfloat16",
        }

    def vision_config(self) -> dict:
        """`vision_config` of config.json (vLLM's KimiK3VisionConfig)."""
        return {
            "model_type": "kimi_k3_vision", "patch_size": self.patch_size,
            "vt_hidden_size": self.vt_hidden_size,
            "vt_num_hidden_layers": self.vt_num_hidden_layers,
            "vt_num_attention_heads": self.vt_num_attention_heads,
            "vt_intermediate_size": self.vt_intermediate_size,
            "qkv_hidden_size": self.vt_qkv_hidden_size, "merge_kernel_size": [2, 2],
            "mm_projector_type": "patchmergerv2", "text_hidden_size": self.hidden_size,
        }


def token_id(token: str) -> int:
    """Id of one of `SPECIAL_TOKENS` in the tokenizer `write_tokenizer` writes."""
    return NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(token)


def write_k3_config(directory: str | Path, dims: K3Dims = K3Dims()) -> Path:
    """Write a K3 checkpoint's config.json, preprocessor_config.json and tokenizer; no weights."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": dims.text_config(), "vision_config": dims.vision_config(),
        "media_placeholder_token_id": token_id("<|media_pad|>"),
        "image_placeholder": "<|kimi_image_placeholder|>",
        "pad_token_id": token_id("[PAD]"), "torch_dtype": "bfloat16",
    }
    _write_json(directory / "config.json", config)
    _write_json(directory / "preprocessor_config.json", {"media_proc_cfg": {
        "patch_size": dims.patch_size, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
        "in_patch_limit": 16384, "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None, "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5]}})
    write_tokenizer(directory, dims.vocab_size)
    return directory


def write_dspark_config(directory: str | Path, dims: K3Dims = K3Dims(), *,
                        num_hidden_layers: int = 1, target_layer_ids: list[int] | None = None,
                        block_size: int = 7, markov_rank: int = 32) -> Path:
    """Write a K3 DSpark draft's config.json (dense MLA, vLLM's K3DSparkConfig); no weights.

    `target_layer_ids` (0-based target layers whose hidden states feed `context_proj`; default:
    the first, middle and last) and `block_size` (tokens drafted per pass) are DSpark's own.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = dims.num_hidden_layers
    layers = target_layer_ids or sorted({0, n // 2, n - 1})
    _write_json(directory / "config.json", {
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
        "vocab_size": dims.vocab_size, "draft_vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size, "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_attention_heads, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "q_lora_rank": dims.q_lora_rank, "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": dims.qk_nope_head_dim, "qk_rope_head_dim": dims.qk_rope_head_dim,
        "v_head_dim": dims.v_head_dim, "rope_theta": dims.rope_theta,
        "max_position_embeddings": dims.max_position_embeddings,
        "target_hidden_size": dims.hidden_size, "target_layer_ids": layers,
        "num_target_layers": len(layers), "block_size": block_size, "markov_rank": markov_rank,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    })
    return directory


def write_qwen3_dspark_config(directory: str | Path, dims: K3Dims = K3Dims()) -> Path:
    """Write a DSpark draft of model_type qwen3 (dense attention), which vLLM runs as
    `Qwen3DSparkModel`, not as K3's MLA drafter; config.json only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "config.json", {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
        "hidden_size": dims.hidden_size, "intermediate_size": dims.intermediate_size,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "num_hidden_layers": 1,
        "vocab_size": dims.vocab_size, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "target_layer_ids": [0], "block_size": 7, "torch_dtype": "bfloat16"})
    return directory


def write_speculators_dspark_config(directory: str | Path, dims: K3Dims = K3Dims(), *,
                                    speculative_tokens: int = 8) -> Path:
    """Write a DSpark draft in the speculators format, as vLLM's K3 recipe's draft ships
    (`speculators_model_type: dspark` around a Qwen3 `transformer_layer_config`), which vLLM runs
    as a dense `Qwen3DSparkModel` (vllm/transformers_utils/configs/speculators/algos.py
    `update_dspark`); config.json only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = dims.num_hidden_layers
    _write_json(directory / "config.json", {
        "architectures": ["DSparkSpeculator"], "model_type": "speculators",
        "speculators_model_type": "dspark",
        "speculators_config": {
            "proposal_methods": [{"proposal_type": "dspark",
                                  "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": "moonshotai/Kimi-K3",
                         "architectures": ["KimiK3ForConditionalGeneration"]}},
        "transformer_layer_config": {
            "model_type": "qwen3", "hidden_size": dims.hidden_size,
            "intermediate_size": dims.intermediate_size, "num_attention_heads": 8,
            "num_key_value_heads": 8, "head_dim": 8, "num_hidden_layers": 1,
            "vocab_size": dims.vocab_size, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"},
        "aux_hidden_state_layer_ids": sorted({1, n // 2 + 1, n}),
        "mask_token_id": dims.vocab_size - 1, "block_size": speculative_tokens,
        "draft_vocab_size": dims.vocab_size, "target_hidden_size": dims.hidden_size,
        "torch_dtype": "bfloat16"})
    return directory


def write_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Byte-level BPE over 256 byte tokens (no merges) plus `SPECIAL_TOKENS`, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's "
                         f"{tokenizer.get_vocab_size()} tokens")
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]",
        "eos_token": "<|im_end|>", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
    })
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
