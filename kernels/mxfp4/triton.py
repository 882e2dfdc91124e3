"""Triton fast paths for MXFP4: a dequantize kernel and a matmul that decodes the weights on the fly.

The wrappers take the same arguments as moonserve.kernels.mxfp4.naive's ``dequantize`` and ``matmul`` and give
the same results (dequantize bit-exact, matmul up to float32 summation order), plus an optional
``out=`` buffer. This module needs triton; moonserve.kernels.mxfp4 itself imports without it.

Example (CPU tensors, as here, need ``TRITON_INTERPRET=1`` set before triton is first imported; on a
GPU, pass CUDA tensors):

    >>> import torch
    >>> from moonserve.kernels.mxfp4 import naive
    >>> from moonserve.kernels.mxfp4 import triton as mxfp4_triton
    >>> w_blocks, w_scales = naive.quantize(torch.randn(781, 1824))  # [781, 57, 16], [781, 57]
    >>> y = mxfp4_triton.matmul(torch.randn(63, 1824), w_blocks, w_scales)  # [63, 781]
"""

from __future__ import annotations

import torch

from moonserve.kernels.mxfp4.naive import BLOCK_SIZE, check_matmul_shapes, check_packed

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # keep the message actionable; moonserve.kernels.mxfp4 never imports this module
    raise ImportError("moonserve.kernels.mxfp4.triton needs triton; use moonserve.kernels.mxfp4.naive without it") from exc


@triton.jit
def _decode_e2m1(codes):
    """int32 E2M1 codes 0..15 -> float32 values (0, 0.5, ..., 6 and negatives)."""
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    # Normal codes: (1 + m / 2) * 2**(e - 1) as a float32 bit pattern; e = 0 is the subnormal m / 2.
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, normal)
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _decode_e8m0(scale_codes):
    """int32 biased exponents -> float32 2**(e - 127); 0 is the subnormal 2**-127, 255 is NaN."""
    scale = (scale_codes << 23).to(tl.float32, bitcast=True)
    scale = tl.where(scale_codes == 0, 2.0**-127, scale)
    return tl.where(scale_codes == 255, float("nan"), scale)


@triton.jit
def _load_weight_tile(blocks_ptr, scales_ptr, rows, cols, num_rows, K):
    """Decoded weights [len(rows), len(cols)] in float32; zero outside num_rows x K."""
    mask = (rows[:, None] < num_rows) & (cols[None, :] < K)
    rows = rows.to(tl.int64)  # expert-stacked weights pass 2**31 elements
    packed = tl.load(blocks_ptr + rows[:, None] * (K // 2) + cols[None, :] // 2, mask=mask, other=0)
    scale_codes = tl.load(scales_ptr + rows[:, None] * (K // 32) + cols[None, :] // 32, mask=mask, other=0)
    # Even elements sit in the low nibble, odd ones in the high nibble.
    codes = (packed.to(tl.int32) >> ((cols[None, :] & 1) * 4)) & 0xF
    values = _decode_e2m1(codes) * _decode_e8m0(scale_codes.to(tl.int32))
    return tl.where(mask, values, 0.0)


@triton.jit
def _dequantize_kernel(blocks_ptr, scales_ptr, out_ptr, num_rows, K,
                       BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    values = _load_weight_tile(blocks_ptr, scales_ptr, rows, cols, num_rows, K)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < K)
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(x_ptr, blocks_ptr, scales_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_IN_BF16: tl.constexpr):
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x_mask = (rows_m[:, None] < M) & (cols[None, :] < K)
        x_offsets = rows_m.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
        x = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _load_weight_tile(blocks_ptr, scales_ptr, rows_n, cols, N, K)  # [BLOCK_N, BLOCK_K]
        if DOT_IN_BF16:
            # MXFP4 values need 2 significant bits, so w is exact in bf16: tensor cores, no loss.
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:
            # "ieee", not the tf32 default: fp32 activations keep fp32 products.
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    out_mask = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    out_offsets = rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {shape} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               *, out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., K // 32, 16] and scales uint8 [..., K // 32] -> [..., K] in dtype.

    Bit-exact with moonserve.kernels.mxfp4.naive.dequantize. ``out`` ([..., K], dtype) is written if given.
    """
    check_packed(blocks, scales)
    num_blocks = blocks.shape[-2]
    K = num_blocks * BLOCK_SIZE
    shape = (*blocks.shape[:-2], K)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    _check_out(out, shape, dtype, blocks.device)
    num_rows = out.numel() // K
    if num_rows == 0:
        return out
    block_rows, block_k = 16, 256
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(K, block_k))
    _dequantize_kernel[grid](blocks.contiguous(), scales.contiguous(), out, num_rows, K,
                             BLOCK_ROWS=block_rows, BLOCK_K=block_k)
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
           *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ dequantize(W).T, W as MXFP4 blocks [N, K // 32, 16], scales [N, K // 32].

    Weights are decoded tile by tile in registers and never written out; products accumulate in
    fp32. Returns [M, N] in x.dtype (``out`` is written if given).
    """
    check_packed(blocks, scales)
    check_matmul_shapes(x, blocks)
    M, K = x.shape
    N = blocks.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _check_out(out, (M, N), x.dtype, x.device)
    if M == 0 or N == 0:
        return out
    # tl.dot needs every tile side >= 16; small M (decode) gets a small tile, not a padded 64.
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n, block_k = 64, 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _matmul_kernel[grid](x, blocks.contiguous(), scales.contiguous(), out, M, N, K,
                         x.stride(0), x.stride(1), out.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         DOT_IN_BF16=x.dtype == torch.bfloat16)
    return out
