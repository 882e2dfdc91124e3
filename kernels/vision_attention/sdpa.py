"""The torch path for CPUs: rotary, then ``scaled_dot_product_attention`` over images of equal length.

Same contract as moonserve.kernels.vision_attention.naive.varlen_attention. Images with the same number of
tokens (a batch of same-sized images, the common case) go through one batched SDPA call instead of
one call each, which is what makes a packed batch cheaper than a per-image loop on a CPU.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from moonserve.kernels.vision_attention.naive import apply_rotary, check_cu_seqlens_cover, check_varlen_inputs


def group_by_length(bounds: list[int]) -> dict[int, list[int]]:
    """Sequence start offsets keyed by sequence length (empty sequences left out)."""
    groups: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            groups.setdefault(end - start, []).append(start)
    return groups


def is_one_run(length: int, starts: list[int]) -> bool:
    """True when the sequences are consecutive and cover every token (starts 0, L, 2L, ...)."""
    return starts == list(range(0, length * len(starts), length))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention over [num_seqs, length, heads, head_dim] batches of equal-length sequences."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)  # [num_seqs, length, heads, head_dim]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Rotary on q and k, then attention within each image: [total_tokens, heads, head_dim] in v.dtype."""
    check_varlen_inputs(q, k, v, cu_seqlens, cos, sin)
    bounds = check_cu_seqlens_cover(cu_seqlens, q.shape[0])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = apply_rotary(q, cos, sin).to(v.dtype), apply_rotary(k, cos, sin).to(v.dtype)
    groups = group_by_length(bounds)
    if len(groups) == 1 and is_one_run(*next(iter(groups.items()))):  # equal images back to back: views only
        (length, starts), = groups.items()
        return sdpa(*(x.unflatten(0, (len(starts), length)) for x in (q, k, v)), scale).flatten(0, 1)
    out = torch.empty_like(v)
    for length, starts in groups.items():
        first = starts[0]
        if is_one_run(length, [s - first for s in starts]):  # one run of equal images: views in
            span = slice(first, first + length * len(starts))
            batch = (x[span].unflatten(0, (len(starts), length)) for x in (q, k, v))
            out[span] = sdpa(*batch, scale).flatten(0, 1)
            continue
        rows = torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)
        out[rows] = sdpa(q[rows], k[rows], v[rows], scale)  # rows [num_seqs, length]
    return out
