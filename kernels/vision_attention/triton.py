"""Triton fast path: varlen flash attention with MoonViT's interleaved 2D rotary fused into the loads.

Same contract as moonserve.kernels.vision_attention.naive.varlen_attention, plus ``max_seqlen`` (host int, so
the launch needs no device sync) and ``out=``. q, k, v may be strided views of a packed QKV buffer
``[total_tokens, 3, heads, head_dim]``; only the last dimension must be contiguous.

Rotary is fused rather than a separate pass: a tile is loaded as its even and odd channels, each
half is rotated in registers, and since a dot product does not care about channel order,
``q . k = q_even . k_even + q_odd . k_odd`` -- two half-width ``tl.dot``s, no rotated copy of q or k
in memory. One program owns BLOCK_M query rows of one image and one head and streams that image's
keys in BLOCK_N tiles with the online softmax (FlashAttention-2, arXiv:2307.08691).

Example (CPU tensors need ``TRITON_INTERPRET=1`` set before triton is first imported):

    >>> import torch
    >>> from moonserve.kernels.vision_attention import naive, triton as vision_triton
    >>> grid_thw = [[1, 9, 7], [1, 1, 1]]
    >>> cos, sin = naive.rope_2d_cos_sin(grid_thw, head_dim=128)  # [64, 64] each
    >>> q, k, v = torch.randn(3, 64, 2, 128).unbind(0)
    >>> out = vision_triton.varlen_attention(q, k, v, naive.cu_seqlens_from_grid_thw(grid_thw), cos, sin)
"""

from __future__ import annotations

import math

import torch

from moonserve.kernels.vision_attention.naive import check_varlen_inputs

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # moonserve.kernels.vision_attention imports this module only when triton is there
    raise ImportError("moonserve.kernels.vision_attention.triton needs triton; use the torch paths without it") from exc


@triton.jit
def _load_rotated(x_ptr, rows, row_mask, stride_token, cos_ptr, sin_ptr, pairs, HALF_DIM):
    """Rows of one head, rotated, as float32 (even channels, odd channels): [len(rows), len(pairs)] each."""
    mask = row_mask[:, None] & (pairs < HALF_DIM)[None, :]
    rows = rows.to(tl.int64)
    offsets = rows[:, None] * stride_token + 2 * pairs[None, :]
    x0 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + offsets + 1, mask=mask, other=0.0).to(tl.float32)
    angle_offsets = rows[:, None] * HALF_DIM + pairs[None, :]
    cos = tl.load(cos_ptr + angle_offsets, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + angle_offsets, mask=mask, other=0.0)
    return x0 * cos - x1 * sin, x1 * cos + x0 * sin


@triton.jit
def _dot(a, b, LOW_PRECISION: tl.constexpr):
    """a @ b accumulated in float32; "ieee" for float32 inputs (not the tf32 default)."""
    if LOW_PRECISION:
        return tl.dot(a, b)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _varlen_rope_attention_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cu_seqlens_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, HEAD_DIM, HALF_DIM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1) - start
    if m_block * BLOCK_M < seqlen:  # grids are sized for the longest image
        local_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        pairs = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        q0, q1 = _load_rotated(q_ptr + head * stride_qh, start + local_m, local_m < seqlen, stride_qt,
                               cos_ptr, sin_ptr, pairs, HALF_DIM)
        q0, q1 = q0 * qk_scale, q1 * qk_scale  # scores come out in log2 units for exp2
        if LOW_PRECISION:
            q0, q1 = q0.to(v_ptr.dtype.element_ty), q1.to(v_ptr.dtype.element_ty)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for n0 in range(0, seqlen, BLOCK_N):
            local_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            key_mask = local_n < seqlen
            k0, k1 = _load_rotated(k_ptr + head * stride_kh, start + local_n, key_mask, stride_kt,
                                   cos_ptr, sin_ptr, pairs, HALF_DIM)
            if LOW_PRECISION:
                k0, k1 = k0.to(v_ptr.dtype.element_ty), k1.to(v_ptr.dtype.element_ty)
            scores = _dot(q0, tl.trans(k0), LOW_PRECISION) + _dot(q1, tl.trans(k1), LOW_PRECISION)
            scores = tl.where(key_mask[None, :], scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_offsets = (start + local_n).to(tl.int64)[:, None] * stride_vt + dims[None, :]
            v_mask = key_mask[:, None] & (dims < HEAD_DIM)[None, :]
            v = tl.load(v_ptr + head * stride_vh + v_offsets, mask=v_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, LOW_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        out_offsets = (start + local_m).to(tl.int64)[:, None] * stride_ot + dims[None, :]
        out_mask = (local_m < seqlen)[:, None] & (dims < HEAD_DIM)[None, :]
        tl.store(out_ptr + head * stride_oh + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a {like.dtype} tensor of shape {tuple(like.shape)} on {like.device} "
                         f"with a contiguous last dimension, got {out.dtype} {tuple(out.shape)} on {out.device}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_sizes(head_dim: int, max_seqlen: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_HALF, BLOCK_D); tl.dot needs every tile side >= 16."""
    block_mn = 64 if max_seqlen > 32 else 16
    return block_mn, block_mn, max(16, triton.next_power_of_2(head_dim // 2)), max(16, triton.next_power_of_2(head_dim))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float | None = None, *,
                     max_seqlen: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary on q and k, then attention within each image: [total_tokens, heads, head_dim] in v.dtype.

    q, k, v: fp32, bf16 or fp16 [total_tokens, heads, head_dim]; cos, sin: [total_tokens, head_dim // 2]
    (float32 math); cu_seqlens: [num_images + 1] on q's device. ``max_seqlen`` is the longest image
    (read from cu_seqlens, with a device sync, when not given).
    """
    check_varlen_inputs(q, k, v, cu_seqlens, cos, sin)
    total, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device) if out is None else out
    _check_out(out, v)
    num_seqs = cu_seqlens.numel() - 1
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if num_seqs else 0
    if total == 0 or num_seqs == 0 or max_seqlen == 0:
        return out
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    cos, sin = (x.float().contiguous() for x in (cos, sin))
    block_m, block_n, block_half, block_d = _block_sizes(head_dim, max_seqlen)
    scale = head_dim**-0.5 if scale is None else scale
    grid = (triton.cdiv(max_seqlen, block_m), num_seqs, heads)
    _varlen_rope_attention_kernel[grid](
        q, k, v, cos, sin, cu_seqlens.to(torch.int32).contiguous(), out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * math.log2(math.e), head_dim, head_dim // 2,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_HALF=block_half, BLOCK_D=block_d,
        LOW_PRECISION=v.dtype != torch.float32,
    )
    return out
