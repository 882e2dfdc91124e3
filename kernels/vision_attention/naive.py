"""Varlen self-attention with MoonViT's 2D rotary embedding, in plain torch: the spec.

Packed layout, as in vLLM's MoonViT (vllm/model_executor/models/kimi_k25_vit.py):

* q, k, v: ``[total_tokens, num_heads, head_dim]``, the tokens of every image back to back;
* ``cu_seqlens``: int32 ``[num_images + 1]``, image i owns tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``;
  a token attends to every token of its own image and to nothing else (no causal mask);
* ``cos``, ``sin``: float32 ``[total_tokens, head_dim // 2]``, one angle per channel pair. Rotary is
  interleaved (pairs ``(x[2j], x[2j + 1])``, not NeoX halves); pair ``2i`` turns by ``col * f_i`` and
  pair ``2i + 1`` by ``row * f_i``, with ``f_i = theta ** (-4i / head_dim)`` (``Rope2DPosEmbRepeated``).

Example:

    >>> import torch
    >>> grid_thw = torch.tensor([[1, 2, 3], [1, 1, 1]])
    >>> cos, sin = rope_2d_cos_sin(grid_thw, head_dim=8)  # [7, 4] each
    >>> cu_seqlens = cu_seqlens_from_grid_thw(grid_thw)
    >>> cu_seqlens.tolist()
    [0, 6, 7]
    >>> q, k, v = torch.randn(3, 7, 2, 8).unbind(0)  # [7, 2, 8] each
    >>> varlen_attention(q, k, v, cu_seqlens, cos, sin).shape
    torch.Size([7, 2, 8])
"""

from __future__ import annotations

import itertools

import torch

ROPE_THETA = 10000.0


def cu_seqlens_from_grid_thw(grid_thw: torch.Tensor | list[list[int]]) -> torch.Tensor:
    """int32 [num_images + 1] prefix sums of t * h * w (on grid_thw's device when it is a tensor)."""
    grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
    lengths = grid.prod(dim=-1)  # [num_images]
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def rope_2d_angles(grid_thw: torch.Tensor | list[list[int]], head_dim: int,
                   theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotation angles float32 [total_tokens, head_dim // 2] for images laid out row-major per frame.

    Same float32 arithmetic as vLLM's ``Rope2DPosEmbRepeated._precompute_freqs_cis``; every frame of a
    video reuses the same 2D positions.
    """
    if head_dim % 4 != 0:
        raise ValueError(f"2D rotary needs head_dim divisible by 4, got {head_dim}")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4).float() / head_dim))  # [head_dim // 4]
    parts = []
    for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist():
        flat = torch.arange(h * w).float()
        x_angles = torch.outer(flat % w, freqs)  # [h * w, head_dim // 4], column position
        y_angles = torch.outer(flat // w, freqs)  # [h * w, head_dim // 4], row position
        angles = torch.stack([x_angles, y_angles], dim=-1).flatten(1)  # [h * w, head_dim // 2]
        parts.append(angles.repeat(t, 1))
    if not parts:
        return torch.empty(0, head_dim // 2)
    return torch.cat(parts)


def rope_2d_cos_sin(grid_thw: torch.Tensor | list[list[int]], head_dim: int,
                    theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32 [total_tokens, head_dim // 2] each, of rope_2d_angles."""
    angles = rope_2d_angles(grid_thw, head_dim, theta)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary: x [tokens, heads, head_dim], cos/sin [tokens, head_dim // 2]; float32 math."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [tokens, heads, head_dim // 2, 2]
    x0, x1 = pairs.unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise a ValueError naming the tensor whose shape does not fit the packed layout."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be [total_tokens, num_heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    expected = (q.shape[0], q.shape[2] // 2)
    if q.shape[2] % 2 or cos.shape != expected or sin.shape != expected:
        raise ValueError(f"cos and sin must be [total_tokens, head_dim // 2] = {expected}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be [num_images + 1], got {tuple(cu_seqlens.shape)}")


def check_cu_seqlens_cover(cu_seqlens: torch.Tensor, total_tokens: int) -> list[int]:
    """cu_seqlens as a list, after checking it runs from 0 to total_tokens without going back.

    Reads cu_seqlens on the host, so the torch paths call it and the GPU path does not.
    """
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != total_tokens or min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to total_tokens={total_tokens}, got {bounds}")
    return bounds


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Rotary on q and k, then softmax attention within each image: [total_tokens, heads, head_dim].

    Computed image by image in float32 and returned in q.dtype; ``scale`` defaults to head_dim**-0.5.
    """
    check_varlen_inputs(q, k, v, cu_seqlens, cos, sin)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = apply_rotary(q, cos, sin).float(), apply_rotary(k, cos, sin).float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = check_cu_seqlens_cover(cu_seqlens, q.shape[0])
    for start, end in itertools.pairwise(bounds):
        qi, ki, vi = (x[start:end].transpose(0, 1) for x in (q, k, v.float()))  # [heads, len, head_dim]
        weights = torch.softmax(qi @ ki.transpose(1, 2) * scale, dim=-1)  # [heads, len, len]
        out[start:end] = (weights @ vi).transpose(0, 1)
    return out.to(v.dtype)
