"""MXFP4: hand-built bit patterns, exact round trips, an error bound, and Triton (interpreter) vs naive."""

from __future__ import annotations

import doctest
import re

import pytest
import torch

from moonserve.kernels.checks import relative_rms
from moonserve.kernels.mxfp4 import naive
from moonserve.kernels.mxfp4.naive import dequantize, matmul, quantize

# Magnitudes of E2M1 codes 0..7, written out here rather than taken from naive.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_SIGNED = torch.cat([E2M1, -E2M1])  # [16], indexed by code


def one_block(*values: float) -> torch.Tensor:
    """[1, 32] float32: the given leading values, zeros after."""
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x


def codes_of(blocks: torch.Tensor) -> list[int]:
    """The 4-bit codes of a packed [..., 16] row, unpacked by hand: low nibble first."""
    return [nibble for byte in blocks.flatten().tolist() for nibble in (byte & 0xF, byte >> 4)]


def test_docstring_examples_run():
    assert doctest.testmod(naive).failed == 0


def test_block_with_amax_6_packs_expected_bytes():
    # Ties go to the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1, 1.75 -> 2, 3.5 -> 4, 5 -> 4.
    blocks, scales = quantize(one_block(6.0, 0.25, 0.75, 5.0, -6.0, 1.75, 3.5, -6.0))
    assert scales.tolist() == [[127]]  # floor(log2(6)) - 2 = 0
    assert blocks.shape == (1, 1, 16)
    # codes 7, 0 | 2, 6 | 15, 4 | 6, 15: the even element in the low nibble; -6 is code 15 in either.
    assert blocks[0, 0, :4].tolist() == [0x07, 0x62, 0x4F, 0xF6]
    assert blocks[0, 0, 4:].tolist() == [0] * 12
    assert dequantize(blocks, scales)[0, :8].tolist() == [6.0, 0.0, 1.0, 4.0, -6.0, 2.0, 4.0, -6.0]


@pytest.mark.parametrize(
    "value, code",
    [
        (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties: even code
        (0.26, 1), (0.74, 1), (1.3, 3), (2.6, 5), (4.9, 6), (5.1, 7),  # off ties: nearest
        (-0.75, 10), (-5.0, 14), (-1.5, 11), (-0.1, 8),  # sign bit 3; -0.1 rounds to -0
    ],
)
def test_rounding_at_unit_scale(value, code):
    blocks, scales = quantize(one_block(6.0, value))  # 6 pins the scale to 2**0
    assert scales.item() == 127
    assert codes_of(blocks)[:2] == [7, code]


@pytest.mark.parametrize(
    "amax, scale_code",
    [
        (6.0, 127), (4.0, 127), (7.99, 127), (8.0, 128), (3.99, 126), (1.0, 125),
        (8.0 * (1.0 - 2.0**-24), 127),  # float32 log2 of this is 3.0; floor(log2) is 2
        (2.0**-125, 0),  # the smallest scale, 2**-127, exactly
        (2.0**-140, 0),  # below the E8M0 range: clamped to 2**-127
        (3.0e38, 252),  # floor(log2) = 127 -> 125
    ],
)
def test_shared_exponent_follows_amax(amax, scale_code):
    _, scales = quantize(one_block(-amax, amax / 2))
    assert scales.item() == scale_code


def test_values_between_6_and_8_saturate():
    blocks, scales = quantize(one_block(7.5, -7.99, 6.5, 1.0))
    assert scales.item() == 127
    assert codes_of(blocks)[:4] == [7, 15, 7, 2]
    assert dequantize(blocks, scales)[0, :4].tolist() == [6.0, -6.0, 6.0, 1.0]


def test_all_zero_block_gets_smallest_scale():
    x = torch.cat([torch.zeros(1, 32), one_block(3.0)], dim=1)  # [1, 64]: zero block, then amax 3
    blocks, scales = quantize(x)
    assert scales.tolist() == [[0, 126]]
    assert blocks[0, 0].tolist() == [0] * 16
    assert torch.equal(dequantize(blocks, scales), x)


def test_non_finite_block_gets_nan_scale_only_there():
    x = torch.cat([one_block(1.0, float("nan")), one_block(float("inf")), one_block(2.0)], dim=1)
    blocks, scales = quantize(x)
    assert scales.tolist() == [[255, 255, 126]]
    y = dequantize(blocks, scales)  # [1, 96]
    assert y[0, :64].isnan().all()
    assert y[0, 64:].tolist() == x[0, 64:].tolist()


@pytest.mark.parametrize("shape", [(2, 48), (31,), ()])
def test_k_not_multiple_of_32_names_the_shape(shape):
    with pytest.raises(ValueError, match=re.escape(f"got shape {tuple(shape)}")):
        quantize(torch.zeros(shape))


def random_representable(
    rows: int, num_blocks: int, generator: torch.Generator, amax_6: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 data built without naive: (x [rows, K], codes [rows, num_blocks, 32], scale codes).

    With amax_6 every block holds a +-6, so quantize must give back these very codes and scales;
    without it each block's largest magnitude code is drawn from 1..7.
    """
    shape = (rows, num_blocks, 32)
    if amax_6:
        top = torch.full((rows, num_blocks, 1), 7)
    else:
        top = torch.randint(1, 8, (rows, num_blocks, 1), generator=generator)
    magnitude = (torch.rand(shape, generator=generator) * (top + 1)).long()  # 0..top
    magnitude[..., :1] = top
    negative = torch.randint(0, 2, shape, generator=generator).bool() & (magnitude > 0)  # no -0 code
    codes = magnitude + 8 * negative
    scale_codes = torch.randint(0, 253, (rows, num_blocks), generator=generator)  # 253+ overflow fp32
    x = torch.ldexp(E2M1_SIGNED[codes].double(), (scale_codes - 127).unsqueeze(-1).double())
    return x.flatten(-2).float(), codes, scale_codes


def test_round_trip_is_exact_for_representable_inputs():
    generator = torch.Generator().manual_seed(0)
    x, codes, scale_codes = random_representable(64, 24, generator)
    blocks, scales = quantize(x)
    assert torch.equal(scales.long(), scale_codes)
    assert torch.equal(torch.tensor(codes_of(blocks)), codes.flatten())
    assert torch.equal(dequantize(blocks, scales), x)
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16), x.bfloat16())  # exact in bf16 too


def test_round_trip_is_exact_when_blocks_lack_6():
    # Blocks of small codes get a smaller shared exponent; their values stay representable.
    x, _, _ = random_representable(64, 24, torch.Generator().manual_seed(6), amax_6=False)
    assert torch.equal(dequantize(*quantize(x)), x)


def test_every_element_rounds_to_a_nearest_block_value():
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize(x)
    y = dequantize(blocks, scales)
    scale = naive.e8m0_to_float32(scales).repeat_interleave(32, dim=-1)  # [64, 1024]
    candidates = E2M1_SIGNED * scale.unsqueeze(-1)  # [64, 1024, 16]
    nearest = (candidates - x.unsqueeze(-1)).abs().amin(dim=-1)
    assert torch.equal((y - x).abs(), nearest)


def test_quantization_error_on_gaussian_inputs():
    # N(0, 1) through MXFP4 measures 0.115 +- 0.001 (seeds and sizes from 64x4096 to 512x4096);
    # the same data with the shared exponent one too high gives 0.144 and one too low 0.28, so
    # 0.125 holds with margin and still catches an off-by-one scale.
    x = torch.randn(128, 4096, generator=torch.Generator().manual_seed(2))
    assert relative_rms(dequantize(*quantize(x)), x) < 0.125


def test_naive_matmul_is_x_times_dequantized_transpose():
    generator = torch.Generator().manual_seed(3)
    w, _, _ = random_representable(40, 3, generator)  # [40, 96], exactly representable
    x = torch.randn(5, 96, generator=generator)
    blocks, scales = quantize(w)
    assert torch.allclose(matmul(x, blocks, scales), x @ w.T, rtol=1e-6, atol=0)
    assert matmul(x.bfloat16(), blocks, scales).dtype == torch.bfloat16


# The Triton cases run in a TRITON_INTERPRET=1 child (conftest.py: `triton_results`).
# Only float32: the interpreter's bf16 tl.dot is wrong; gpu_check.py covers bf16 on a GPU.
TRITON_DEQUANTIZE_CASES = [((781, 1824), "float32"), ((3, 5, 96), "bfloat16")]
TRITON_MATMUL_SHAPES = [(63, 781, 1824), (1, 33, 96)]


def run_triton_dequantize(mxfp4_triton, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    blocks, scales = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(4)))
    scales[0, ..., 1] = 255  # a NaN block, which must stay NaN
    expected = dequantize(blocks, scales, dtype)
    poisoned = torch.full(expected.shape, float("nan"), dtype=dtype)  # unwritten elements stay NaN
    actual = mxfp4_triton.dequantize(blocks, scales, dtype, out=poisoned)
    return {
        "nan_where_expected": torch.equal(actual.isnan(), expected.isnan()),
        "bit_exact": torch.equal(actual.nan_to_num(), expected.nan_to_num()),
    }


def run_triton_matmul(mxfp4_triton, m: int, n: int, k: int) -> dict:
    generator = torch.Generator().manual_seed(5)
    blocks, scales = quantize(torch.randn(n, k, generator=generator))
    x = torch.randn(m, k, generator=generator)
    poisoned = torch.full((m, n), float("nan"))  # unwritten elements stay NaN
    actual = mxfp4_triton.matmul(x, blocks, scales, out=poisoned)
    expected = matmul(x, blocks, scales)
    return {"unwritten": int(actual.isnan().sum()), "relative_rms": relative_rms(actual, expected)}


def run_triton_cases() -> dict:
    """Entry point of the TRITON_INTERPRET=1 child: every Triton case, as JSON-able results."""
    from triton.runtime.interpreter import InterpretedFunction

    from moonserve.kernels.mxfp4 import triton as mxfp4_triton

    kernels = [mxfp4_triton._dequantize_kernel, mxfp4_triton._matmul_kernel]
    return {
        "interpreted": all(isinstance(kernel, InterpretedFunction) for kernel in kernels),
        "dequantize": {str(shape): run_triton_dequantize(mxfp4_triton, shape, getattr(torch, dtype))
                       for shape, dtype in TRITON_DEQUANTIZE_CASES},
        "matmul": {str(shape): run_triton_matmul(mxfp4_triton, *shape) for shape in TRITON_MATMUL_SHAPES},
    }


def test_triton_kernels_run_in_the_interpreter(triton_results):
    assert triton_results["interpreted"]


@pytest.mark.parametrize("shape, dtype", TRITON_DEQUANTIZE_CASES)
def test_triton_dequantize_is_bit_exact(triton_results, shape, dtype):
    assert triton_results["dequantize"][str(shape)] == {"nan_where_expected": True, "bit_exact": True}


@pytest.mark.parametrize("shape", TRITON_MATMUL_SHAPES)
def test_triton_matmul_matches_naive(triton_results, shape):
    result = triton_results["matmul"][str(shape)]
    assert result["unwritten"] == 0
    assert result["relative_rms"] <= 1e-5


def test_triton_wrappers_reject_what_naive_rejects():
    # Checks happen before any launch, so this runs in this process, interpreter or not.
    mxfp4_triton = pytest.importorskip("moonserve.kernels.mxfp4.triton", reason="triton is not installed")
    blocks, scales = quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"blocks \(4, 2, 16\) and scales \(4, 1\)"):
        mxfp4_triton.dequantize(blocks, scales[:, :1])
    with pytest.raises(ValueError, match=r"x torch.float32 \(3, 32\)"):
        mxfp4_triton.matmul(torch.randn(3, 32), blocks, scales)
    with pytest.raises(ValueError, match="out must be"):
        mxfp4_triton.matmul(torch.randn(3, 64), blocks, scales, out=torch.empty(4, 3))
