"""The embedded DSpark drafter, built from the embedded target (`moonserve prepare`).

`prepare_drafter()` copies the final norm and `EMBEDDED_TARGET_LAYER_IDS` of SmolLM2-135M-Instruct
and shares its tied embedding / LM head (the checkpoint does not store them; the DraftService passes
the target's at load time, as vLLM aliases a K3 draft's). The Markov head is the drafter's own
bigram prediction compressed to rank 64; the mask embedding is the mean token embedding. Nothing is
trained: why these layers, and what the drafter accepts, is measured in docs/speculative.md.
`quantize_drafter_checkpoint` writes an MXFP4 copy of a drafter checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from moonserve.kernels.mxfp4.linear import quantize_linear_weights
from moonserve.kernels.mxfp4.naive import BLOCK_SIZE
from moonserve.pipeline.models.dspark import (
    DEFAULT_MARKOV_RANK,
    DSparkConfig,
    DSparkModel,
    check_supported,
    load_model,
    save_model,
    target_shared_tensors,
)
from moonserve.pipeline.models.weights import load_tensors
from moonserve.pipeline.prepare.store import CONFIG_FILE, WEIGHTS_FILE, Artifact, build_dir

# Measured by `moonserve.pipeline.bench.acceptance.measure_layer_choices`: docs/speculative.md.
EMBEDDED_TARGET_LAYER_IDS = (0, 1, 2, 3)
EMBEDDED_MARKOV_RANK = DEFAULT_MARKOV_RANK
EMBEDDED_DRAFTER = Artifact("dspark-embedded", format_version=1)


def prepare_drafter(lm_path: Path | str | None = None, home: Path | None = None) -> Path:
    """The embedded DSpark drafter, built from the embedded target's embedding, LM head and a few
    of its layers; idempotent. Built from another LM (the tiny test model), it has a folder of
    its own.

    Not a trained drafter: its block positions after the first are weak (docs/speculative.md);
    a real DSpark checkpoint goes in `draft.model`.
    """
    from moonserve.pipeline.prepare.language_model import embedded_lm_dir

    lm_dir = Path(lm_path or embedded_lm_dir(home))
    weights = lm_dir / WEIGHTS_FILE
    source = {"file": weights.name, "bytes": weights.stat().st_size}
    num_layers = json.loads((lm_dir / CONFIG_FILE).read_text())["num_hidden_layers"]
    layer_ids = tuple(i for i in EMBEDDED_TARGET_LAYER_IDS if i < num_layers)  # the tiny LM: 2
    artifact = EMBEDDED_DRAFTER.for_target(lm_dir, embedded_lm_dir(home))
    return artifact.ensure(home, lambda staging: write_embedded_dspark(lm_dir, staging, layer_ids),
                           record={"source": source})


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
        >>> from moonserve.pipeline.speculative.dspark import DSparkDrafter
        >>> lm_dir = prepare_language_model()  # doctest: +SKIP
        >>> path = build_embedded_dspark(lm_dir, Path("/tmp/dspark"))  # doctest: +SKIP
        >>> drafter = DSparkDrafter.from_pretrained(  # doctest: +SKIP
        ...     path, shared=target_shared_tensors(lm_dir))
        >>> drafter.model.config.target_layer_ids  # doctest: +SKIP
        (0, 1, 2, 3)
    """
    return build_dir(Path(out_dir), lambda staging: write_embedded_dspark(
        lm_dir, staging, target_layer_ids, markov_rank))


def write_embedded_dspark(
    lm_dir: Path,
    out_dir: Path,
    target_layer_ids: tuple[int, ...] = EMBEDDED_TARGET_LAYER_IDS,
    markov_rank: int = EMBEDDED_MARKOV_RANK,
) -> None:
    model = dspark_from_llama(lm_dir, target_layer_ids, markov_rank)
    derive_markov_head(model)
    save_model(model, out_dir)


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
    packed = quantize_linear_weights(load_tensors(src_dir), lambda name, _: name in names)

    def write(staging: Path) -> None:
        shutil.copyfile(src_dir / CONFIG_FILE, staging / CONFIG_FILE)
        save_file(packed, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})

    return build_dir(Path(out_dir), write)


def mxfp4_weight_names(config: DSparkConfig) -> frozenset[str]:
    """The `X.weight`s `quantize_drafter_checkpoint` packs (see there)."""
    with torch.device("meta"):
        model = DSparkModel(config)  # tied: an LM head of the checkpoint's own stays float
    return frozenset(f"{name}.weight" for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and m.in_features % BLOCK_SIZE == 0)
