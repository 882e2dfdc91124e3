"""Triton fast path for patchify: uint8 HWC pixels -> padded, normalized patches in one pass.

Same arguments and results as moonserve.kernels.patchify.naive.patchify run on the CPU (bit-exact: the
kernel reads each normalized value from a float32 table computed on the CPU with the naive formula,
so no GPU division rounding enters), plus an optional ``out=`` buffer. This module needs triton; moonserve.kernels.patchify itself
imports without it.

Example (CPU tensors, as here, need ``TRITON_INTERPRET=1`` set before triton is first imported; on a
GPU, pass CUDA tensors):

    >>> import torch
    >>> from moonserve.kernels.patchify import triton as patchify_triton
    >>> pixels = torch.randint(0, 256, (1823, 781, 3), dtype=torch.uint8)  # [H, W, 3]
    >>> patches = patchify_triton.patchify(pixels, (132, 56), (0.5,) * 3, (0.5,) * 3)  # [7392, 3, 14, 14]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from moonserve.kernels.patchify.naive import NUM_CHANNELS, PATCH_SIZE, check_inputs, normalize_lut

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # keep the message actionable; moonserve.kernels.patchify never imports this module
    raise ImportError("moonserve.kernels.patchify.triton needs triton; use moonserve.kernels.patchify.naive without it") from exc

BLOCK = 1024


@triton.jit
def _patchify_kernel(pixels_ptr, lut_ptr, out_ptr, height, width, grid_w, total,
                     PATCH: tl.constexpr, BLOCK: tl.constexpr):
    # One program writes BLOCK consecutive output elements: stores are contiguous, loads gather.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] into out
    mask = offsets < total
    patch = offsets // (3 * PATCH * PATCH)
    within = offsets % (3 * PATCH * PATCH)
    channel = within // (PATCH * PATCH)
    y = (patch // grid_w) * PATCH + (within // PATCH) % PATCH
    x = (patch % grid_w) * PATCH + within % PATCH
    inside = mask & (y < height) & (x < width)
    # Padding reads value 0, which normalizes to (0 - mean) / std, as in the naive spec.
    value = tl.load(pixels_ptr + (y * width + x) * 3 + channel, mask=inside, other=0)
    normalized = tl.load(lut_ptr + value.to(tl.int32) * 3 + channel, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, normalized.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=16)
def _device_lut(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The normalization table, computed on the CPU (the bit pattern vLLM's CPU path produces; CUDA
    may divide by a scalar as a multiply by its reciprocal) and copied to the device once."""
    return normalize_lut(mean, std).to(device)


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {shape} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def patchify(
    pixels: torch.Tensor,
    grid_hw: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    patch_size: int = PATCH_SIZE,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 pixels [H, W, 3] -> normalized patches [grid_h * grid_w, 3, P, P] in dtype.

    Bit-exact with moonserve.kernels.patchify.naive.patchify. ``out`` is written if given.
    """
    check_inputs(pixels, grid_hw, patch_size)
    grid_h, grid_w = grid_hw
    shape = (grid_h * grid_w, NUM_CHANNELS, patch_size, patch_size)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=pixels.device)
    _check_out(out, shape, dtype, pixels.device)
    lut = _device_lut(tuple(mean), tuple(std), pixels.device)  # [256, 3] float32
    total = out.numel()
    _patchify_kernel[(triton.cdiv(total, BLOCK),)](
        pixels.contiguous(), lut, out, pixels.shape[0], pixels.shape[1], grid_w, total,
        PATCH=patch_size, BLOCK=BLOCK,
    )
    return out
