"""GPU check of the MXFP4 Triton kernels against moonserve.kernels.mxfp4.naive; prints one JSON object.

Run from the repository root on a CUDA machine (as a module, so that ``import triton`` finds the
real triton and not kernels/mxfp4/triton.py):

    python -m moonserve.kernels.mxfp4.gpu_check

For each shape and activation dtype it reports the matmul's max and relative-RMS error against
the float32 reference, whether dequantize is bit-exact, and the median time of the fused Triton
matmul against Triton dequantize followed by torch.matmul. Exit status: 0 if every case is within
tolerance, 1 if any is not, 2 without a CUDA device.
"""

from __future__ import annotations

import sys

import torch

from moonserve.kernels.checks import gpu_check_main, relative_rms, time_ms
from moonserve.kernels.mxfp4 import naive

# (M, N, K): tile edges everywhere; a gpt-oss-sized decode step; a prefill-sized batch.
SHAPES = [(63, 781, 1824), (1, 2880, 2880), (512, 5760, 2880)]
# fp32: products are exact, only the summation order differs from torch.
# bf16: one rounding of each output, at most 2**-8 relative.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8}


def prepare_case(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """Activations x [M, K] in dtype and MXFP4 weights (blocks [N, K // 32, 16], scales [N, K // 32])."""
    generator = torch.Generator(device).manual_seed(0)
    blocks, scales = naive.quantize(torch.randn(n, k, device=device, generator=generator))
    x = torch.randn(m, k, device=device, generator=generator).to(dtype)
    return x, blocks, scales


def check_numerics(mxfp4_triton, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> dict:
    expected = naive.matmul(x.float(), blocks, scales)  # [M, N], float32 reference
    poisoned = torch.full(expected.shape, float("nan"), dtype=x.dtype, device=x.device)
    actual = mxfp4_triton.matmul(x, blocks, scales, out=poisoned).float()
    error = actual - expected
    rel_rms = relative_rms(actual, expected)
    dequantized = mxfp4_triton.dequantize(blocks, scales, x.dtype)
    dequantize_bit_exact = torch.equal(dequantized, naive.dequantize(blocks, scales, x.dtype))
    unwritten = int(actual.isnan().sum())
    return {
        "max_abs_error": error.abs().max().item(),
        "relative_rms": rel_rms,
        "unwritten": unwritten,
        "dequantize_bit_exact": dequantize_bit_exact,
        "passed": rel_rms <= TOLERANCE[x.dtype] and unwritten == 0 and dequantize_bit_exact,
    }


def time_case(mxfp4_triton, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> dict:
    fused_ms = time_ms(lambda: mxfp4_triton.matmul(x, blocks, scales))
    unfused_ms = time_ms(lambda: x @ mxfp4_triton.dequantize(blocks, scales, x.dtype).T)
    return {"triton_matmul_ms": fused_ms, "dequantize_then_torch_matmul_ms": unfused_ms,
            "speedup": unfused_ms / fused_ms}


def run_case(mxfp4_triton, m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    x, blocks, scales = prepare_case(m, n, k, dtype, "cuda")
    numerics = check_numerics(mxfp4_triton, x, blocks, scales)
    return {"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."),
            **numerics, **time_case(mxfp4_triton, x, blocks, scales)}


def run_cases() -> list[dict]:
    from moonserve.kernels.mxfp4 import triton as mxfp4_triton

    return [run_case(mxfp4_triton, *shape, dtype) for shape in SHAPES for dtype in TOLERANCE]


if __name__ == "__main__":
    sys.exit(gpu_check_main(__package__, run_cases))
