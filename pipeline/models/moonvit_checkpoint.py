"""MoonViT from a checkpoint: its vision tensors read by name, checked against the config, loaded.

A Kimi K3 checkpoint keeps the encoder under ``vision_tower.*`` and ``mm_projector.*`` (the names of
``moonserve.pipeline.models.moonvit.MoonViT``'s state dict); checkpoints re-exported from vLLM name
the projector's linears ``mm_projector.linear_1`` / ``linear_2``, read here as ``proj.0`` / ``proj.2``.
A linear weight may come as an MXFP4 pair (``X.weight_blocks`` uint8 [N, G, 16] + ``X.weight_scales``
[N, G], logical [N, G * 32]); load_moonvit then runs that linear as a
``moonserve.kernels.mxfp4.MXFP4Linear``, on the packed weight itself. Which files hold the tensors
is ``moonserve.pipeline.models.weights``' business.

Example:
    >>> model = load_moonvit("/path/to/kimi-k3", dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from pathlib import Path

import torch

from moonserve.kernels.mxfp4.format import BLOCKS_SUFFIX, SCALES_SUFFIX, is_packed_part
from moonserve.kernels.mxfp4.linear import (
    load_weights,
    packed_weight_names,
    packed_weight_shape,
    pair_dtypes_fit,
)
from moonserve.kernels.vision_attention import Backend
from moonserve.pipeline.models.moonvit import (
    MoonViT,
    MoonViTConfig,
    build_on_meta,
    expected_tensor_shapes,
    linear_weight_names,
)
from moonserve.pipeline.models.weights import load_tensors, place_tensors

CHECKPOINT_PREFIXES = ("vision_tower.", "mm_projector.")
# vLLM's own module names for the projector's linears (checkpoints re-exported from vLLM use them);
# Kimi K3's weight mapper turns the checkpoint's proj.0 / proj.2 into these, so both load.
VLLM_NAME_ALIASES = {"mm_projector.linear_1.": "mm_projector.proj.0.", "mm_projector.linear_2.": "mm_projector.proj.2."}


class CheckpointMismatchError(ValueError):
    """A checkpoint's vision tensors do not fit the config; the message names every offending tensor."""


def checkpoint_name(name: str) -> str:
    """The checkpoint's spelling of a tensor name (vLLM's mm_projector.linear_1 -> mm_projector.proj.0)."""
    for alias, canonical in VLLM_NAME_ALIASES.items():
        if name.startswith(alias):
            return canonical + name.removeprefix(alias)
    return name


def read_checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every vision_tower.* and mm_projector.* tensor of a safetensors checkpoint (nothing else is read)."""
    tensors = load_tensors(path, select=lambda name: name.startswith(CHECKPOINT_PREFIXES))
    return {checkpoint_name(name): t for name, t in tensors.items()}


def describe_mismatch(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                      linear_weights: AbstractSet[str] = frozenset()) -> list[str]:
    """One line per missing, unexpected, mis-shaped or non-float tensor, and per MXFP4 pair that is
    incomplete, mis-typed, of the wrong logical shape, or not in place of a linear weight."""
    packed = set(packed_weight_names(tensors)) & set(linear_weights)  # logical names a pair stands for
    problems = [f"missing tensor {name} {list(shape)}" for name, shape in expected.items()
                if name not in tensors and name not in packed]
    problems += [f"unexpected tensor {name} {list(t.shape)}" for name, t in tensors.items()
                 if name not in expected and not is_packed_part(name)]
    for name, t in tensors.items():
        if name in expected and tuple(t.shape) != expected[name]:
            problems.append(f"tensor {name} has shape {list(t.shape)}, the config needs {list(expected[name])}")
        elif name in expected and not t.is_floating_point():
            problems.append(f"tensor {name} has dtype {t.dtype}; MoonViT loads float weights, or linear "
                            f"weights as MXFP4 {name}{BLOCKS_SUFFIX} + {name}{SCALES_SUFFIX}")
    packed_problems = (describe_packed_mismatch(name, tensors, expected, linear_weights)
                       for name in packed_weight_names(tensors))
    return problems + [problem for problem in packed_problems if problem]


def describe_packed_mismatch(name: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                             linear_weights: AbstractSet[str]) -> str | None:
    """The problem, if any, with the MXFP4 pair standing for weight `name` (logical shape [N, G * 32])."""
    blocks, scales = tensors.get(name + BLOCKS_SUFFIX), tensors.get(name + SCALES_SUFFIX)
    if blocks is None or scales is None:
        present, absent = (BLOCKS_SUFFIX, SCALES_SUFFIX) if scales is None else (SCALES_SUFFIX, BLOCKS_SUFFIX)
        return (f"tensor {name}{present} {list(tensors[name + present].shape)} has no {name}{absent}: "
                f"MXFP4 weights come as {BLOCKS_SUFFIX} + {SCALES_SUFFIX} pairs")
    pair = f"{name}{BLOCKS_SUFFIX} {list(blocks.shape)} + {name}{SCALES_SUFFIX} {list(scales.shape)}"
    if name not in linear_weights:
        return f"unexpected tensors {pair}: MoonViT takes MXFP4 pairs for linear weights only"
    if name in tensors:
        return f"tensor {name} comes both as a float tensor and as MXFP4 {pair}"
    if not pair_dtypes_fit(blocks, scales):
        return (f"tensors {pair} have dtypes {blocks.dtype} + {scales.dtype}; MXFP4 needs uint8 blocks "
                "and uint8 (or float8_e8m0fnu) scales")
    shape = packed_weight_shape(blocks, scales)
    if shape != expected[name]:
        held = "no weight: blocks must be [N, G, 16] and scales [N, G]" if shape is None else str(list(shape))
        return f"tensors {pair} hold {held}, the config needs {name} {list(expected[name])}"
    return None


def load_state_dict_from_checkpoint(path: str | Path, cfg: MoonViTConfig) -> dict[str, torch.Tensor]:
    """The vision tower + projector state dict of a safetensors checkpoint (file or directory).

    Linear weights may come as MXFP4 pairs, ``X.weight_blocks`` uint8 [N, G, 16] + ``X.weight_scales``
    [N, G] (logical [N, G * 32]); they are returned as they are. Raises CheckpointMismatchError
    naming every missing, unexpected or mis-shaped tensor.
    """
    tensors = read_checkpoint_tensors(path)
    problems = describe_mismatch(tensors, expected_tensor_shapes(cfg), linear_weight_names(cfg))
    if problems:
        raise CheckpointMismatchError(f"{path}: the MoonViT checkpoint does not fit its config:\n  "
                                      + "\n  ".join(problems))
    return tensors


def load_moonvit(path: str | Path, cfg: MoonViTConfig | None = None, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attention_backend: Backend = "auto") -> MoonViT:
    """A MoonViT in eval mode with a checkpoint's weights; cfg defaults to the directory's config.json.

    Float tensors are cast to dtype; MXFP4 pairs stay packed (uint8) and their linears become
    MXFP4Linear (Triton matmul on GPUs with triton, the torch reference elsewhere).
    """
    if cfg is None:
        cfg = MoonViTConfig.from_pretrained(path if Path(path).is_dir() else Path(path).parent)
    state = place_tensors(load_state_dict_from_checkpoint(path, cfg), device, dtype)
    model = build_on_meta(cfg)
    model.attention_backend = attention_backend
    load_weights(model, state, assign=True)  # MXFP4 pairs turn their nn.Linear into an MXFP4Linear
    return model.eval().requires_grad_(False)
