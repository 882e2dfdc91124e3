"""MXFP4 (OCP Microscaling Formats v1.0) in plain torch: the spec the fast paths are tested against.

Layout, as in the gpt-oss checkpoints and triton_kernels:

* a block is 32 consecutive elements along the last dimension; they share one E8M0 scale;
* each element is a 4-bit E2M1 code (bit 3 = sign; codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6);
* two codes per byte, the even element in the LOW nibble and the odd element in the high nibble;
* ``blocks``: uint8 ``[..., K // 32, 16]``; ``scales``: uint8 ``[..., K // 32]`` holding the
  biased exponent (scale = 2 ** (e - 127), e = 255 is NaN).

Example:

    >>> import torch
    >>> from moonserve.kernels.mxfp4.naive import dequantize, quantize
    >>> x = torch.zeros(1, 32)
    >>> x[0, :4] = torch.tensor([6.0, -0.75, 5.0, 0.25])
    >>> blocks, scales = quantize(x)
    >>> scales.tolist(), [hex(b) for b in blocks[0, 0, :2].tolist()]
    ([[127]], ['0xa7', '0x6'])
    >>> dequantize(blocks, scales)[0, :4].tolist()
    [6.0, -1.0, 4.0, 0.0]
"""

from __future__ import annotations

import torch

from moonserve.kernels.mxfp4.format import BLOCK_SIZE

E8M0_BIAS = 127
E8M0_NAN = 255
# E8M0 codes 0..254 encode 2**-127 .. 2**127.
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E2M1_EMAX = 2
E2M1_SIGN_BIT = 0b1000
# Magnitudes of E2M1 codes 0..7; codes 8..15 are their negatives.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_block_multiple(shape: torch.Size) -> None:
    """Raise a ValueError naming the shape unless its last dimension is a multiple of 32."""
    if len(shape) == 0 or shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"MXFP4 needs the last dimension to be a non-zero multiple of {BLOCK_SIZE}, "
            f"got shape {tuple(shape)}"
        )


def check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise a ValueError unless blocks [..., B, 16] and scales [..., B] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., K // 32, 16] with scales [..., K // 32], "
            f"got blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}"
        )


def check_matmul_shapes(x: torch.Tensor, blocks: torch.Tensor) -> None:
    """Raise a ValueError unless x is a float [M, K] and blocks is [N, K // 32, 16]."""
    k_matches = x.dim() == 2 and blocks.dim() == 3 and x.shape[1] == blocks.shape[1] * BLOCK_SIZE
    if not (x.is_floating_point() and k_matches):
        raise ValueError(
            f"MXFP4 matmul needs float x [M, K] and blocks [N, K // 32, 16], "
            f"got x {x.dtype} {tuple(x.shape)} and blocks {tuple(blocks.shape)}"
        )


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) - emax(E2M1), clamped to the E8M0 range; int32, same shape as amax.

    frexp gives floor(log2) exactly; float32 log2 rounds values just under a power of two up to it.
    An all-zero block has no exponent of its own and gets the smallest one, 2**-127 (code 0).
    """
    _, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    floor_log2 = torch.where(amax > 0, exponent - 1, E8M0_MIN_EXP)
    return (floor_log2 - E2M1_EMAX).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def round_to_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the nearest E2M1 values: ties to the even code, saturate at +-6.

    Even codes are the values whose mantissa bit is 0, so "even code" is IEEE round-half-to-even.
    The sign bit follows the input's sign, so rounding is symmetric about zero (-0.1 -> -0, code 8).
    """
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=scaled.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # [7]: 0.25, 0.75, ..., 5
    mag = scaled.abs()
    # Below a midpoint both agree; on one, `down` is the lower neighbour and `up` the higher.
    down = torch.bucketize(mag, midpoints, right=False)
    up = torch.bucketize(mag, midpoints, right=True)
    code = torch.where(down % 2 == 0, down, up)  # beyond 6 bucketize gives 7: saturation
    return (code + torch.signbit(scaled) * E2M1_SIGN_BIT).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2 * n] uint8 codes -> [..., n] bytes, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2 * n] uint8 codes; inverse of pack_nibbles."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2**(e - 127), exactly; 255 -> NaN.

    Built from the float32 bit pattern, which is exact by construction (exp2 need not be). e = 0
    is the subnormal 2**-127, whose bit pattern is not e << 23.
    """
    e = scales.to(torch.int32)
    value = (e << 23).view(torch.float32)
    value = torch.where(e == 0, 2.0**-127, value)
    return torch.where(e == E8M0_NAN, float("nan"), value)


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 E2M1 values (codes 8..15 are the negatives of 0..7)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    table = torch.cat([magnitudes, -magnitudes])  # [16]
    return table[codes.long()]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (K a multiple of 32) to MXFP4 with the OCP MX v1.0 rule.

    Returns ``(blocks, scales)``: uint8 ``[..., K // 32, 16]`` and uint8 ``[..., K // 32]``.
    A block holding NaN or +-Inf gets the NaN scale (255) and zero codes, so it dequantizes to NaN.

    >>> blocks, scales = quantize(torch.full((2, 64), -3.0))
    >>> blocks.shape, scales.shape, scales[0].tolist(), hex(blocks[0, 0, 0].item())
    (torch.Size([2, 2, 16]), torch.Size([2, 2]), [126, 126], '0xff')
    """
    check_block_multiple(x.shape)
    x_blocks = x.float().unflatten(-1, (-1, BLOCK_SIZE))  # [..., K // 32, 32]
    amax = x_blocks.abs().amax(dim=-1)  # [..., K // 32]; NaN if the block holds one
    finite = torch.isfinite(amax)
    exponent = shared_exponent(torch.where(finite, amax, 0.0))  # [..., K // 32]
    # 2**-exponent is itself an E8M0 value; multiplying by a power of two is exact.
    inverse_scale = e8m0_to_float32((E8M0_BIAS - exponent).to(torch.uint8))  # [..., K // 32]
    scaled = x_blocks * inverse_scale.unsqueeze(-1)
    codes = torch.where(finite.unsqueeze(-1), round_to_e2m1(scaled), 0)  # [..., K // 32, 32]
    scales = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return pack_nibbles(codes), scales


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., K // 32, 16] and scales uint8 [..., K // 32] -> [..., K] in dtype.

    Computed in float32, then cast: every MXFP4 value is exact in float32 and in bfloat16.

    >>> blocks, scales = quantize(torch.arange(32.0).reshape(1, 32))
    >>> dequantize(blocks, scales, torch.bfloat16)[0, [1, 5, 31]].tolist()
    [0.0, 4.0, 24.0]
    """
    check_packed(blocks, scales)
    values = e2m1_to_float32(unpack_nibbles(blocks))  # [..., K // 32, 32]
    values = values * e8m0_to_float32(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)  # [..., K]


def matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequantize(W).T with W given as MXFP4 blocks [N, K // 32, 16], scales [N, K // 32].

    Computed in float32 and returned in x.dtype: [M, N].

    >>> w_blocks, w_scales = quantize(torch.eye(32))
    >>> x = torch.arange(64.0).reshape(2, 32) / 64
    >>> torch.equal(matmul(x, w_blocks, w_scales), x)
    True
    """
    check_packed(blocks, scales)
    check_matmul_shapes(x, blocks)
    weight = dequantize(blocks, scales)  # [N, K]
    return (x.float() @ weight.T).to(x.dtype)
