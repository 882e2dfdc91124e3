"""Varlen self-attention with MoonViT's 2D rotary embedding, one image per attention segment.

``varlen_attention`` dispatches: the Triton kernel (moonserve.kernels.vision_attention.triton) for GPU tensors
when triton is installed, the batched-SDPA torch path (moonserve.kernels.vision_attention.sdpa) otherwise.
``moonserve.kernels.vision_attention.naive`` is the spec both are tested against. This package imports
without triton.

Example:

    >>> import torch
    >>> from moonserve.kernels.vision_attention import cu_seqlens_from_grid_thw, rope_2d_cos_sin, varlen_attention
    >>> grid_thw = [[1, 4, 4], [1, 2, 6]]
    >>> cos, sin = rope_2d_cos_sin(grid_thw, head_dim=64)  # [28, 32] each
    >>> q, k, v = torch.randn(3, 28, 2, 64).unbind(0)  # [28, 2, 64] each
    >>> varlen_attention(q, k, v, cu_seqlens_from_grid_thw(grid_thw), cos, sin).shape
    torch.Size([28, 2, 64])
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

from moonserve.kernels.vision_attention import naive, sdpa
from moonserve.kernels.vision_attention.naive import apply_rotary, cu_seqlens_from_grid_thw, rope_2d_angles, rope_2d_cos_sin

Backend = Literal["auto", "naive", "sdpa", "triton"]

__all__ = ["Backend", "apply_rotary", "cu_seqlens_from_grid_thw", "rope_2d_angles", "rope_2d_cos_sin",
           "select_backend", "varlen_attention"]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(device: torch.device, backend: Backend = "auto") -> Backend:
    """The backend "auto" means on this device: triton on CUDA/ROCm devices that have it, else sdpa."""
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available() else "sdpa"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float | None = None, *,
                     max_seqlen: int | None = None, backend: Backend = "auto") -> torch.Tensor:
    """Rotary on q and k, then softmax attention within each image.

    q, k, v: [total_tokens, heads, head_dim]; cu_seqlens: int32 [num_images + 1]; cos, sin: float32
    [total_tokens, head_dim // 2] (see rope_2d_cos_sin). Returns [total_tokens, heads, head_dim] in
    v.dtype. ``max_seqlen`` (host int) spares the Triton path a device sync.
    """
    chosen = select_backend(q.device, backend)
    if chosen == "triton":
        from moonserve.kernels.vision_attention import triton as vision_triton

        return vision_triton.varlen_attention(q, k, v, cu_seqlens, cos, sin, scale, max_seqlen=max_seqlen)
    if chosen == "naive":
        return naive.varlen_attention(q, k, v, cu_seqlens, cos, sin, scale)
    if chosen == "sdpa":
        return sdpa.varlen_attention(q, k, v, cu_seqlens, cos, sin, scale)
    raise ValueError(f"unknown vision attention backend {backend!r}; use auto, naive, sdpa or triton")
