"""GPU check of the varlen rotary attention kernel; prints one JSON object.

Run from the repository root on a CUDA (or ROCm) machine, as a module so that ``import triton``
finds the real triton and not kernels/vision_attention/triton.py:

    python -m moonserve.kernels.vision_attention.gpu_check

Kernel cases (12 heads of 128, as MoonViT-V2), float32 and bfloat16: relative-RMS error of the
Triton kernel against moonserve.kernels.vision_attention.naive in float32 on the same inputs, unwritten
(NaN-poisoned) outputs, and the median time of the Triton kernel against the SDPA torch path.
MoonViT-V2 on this kernel (the whole encoder, Triton against SDPA) is a benchmark:
`python -m moonserve.pipeline.bench.vision_encoder_gpu`.
Exit status: 0 if every case is within tolerance, 1 if any is not, 2 without a GPU.
"""

from __future__ import annotations

import sys

import torch

from moonserve.kernels.checks import gpu_check_main, relative_rms, time_ms
from moonserve.kernels.vision_attention import naive, sdpa
from moonserve.kernels.vision_attention.naive import cu_seqlens_from_grid_thw, rope_2d_cos_sin

HEADS, HEAD_DIM = 12, 128
# Odd lengths (1, 63, 200, 4096); eight 448x448 images; one 1344x1344 image (9216 patches).
GRIDS = {"odd": [[1, 1, 1], [1, 7, 9], [1, 10, 20], [1, 64, 64]], "8x448px": [[1, 32, 32]] * 8,
         "1344px": [[1, 96, 96]]}
# fp32: ieee dots, only the summation order differs. bf16: q, k (rotated), p and the output are
# each rounded to bf16 once (2**-9 relative each).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def prepare_case(grids: list[list[int]], dtype: torch.dtype) -> tuple:
    """q, k, v as views of one packed [total, 3, heads, head_dim] buffer, cu_seqlens, cos, sin, max_seqlen."""
    total = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator("cuda").manual_seed(0)
    qkv = torch.randn(total, 3, HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
    cos, sin = (x.cuda() for x in rope_2d_cos_sin(grids, HEAD_DIM))
    max_seqlen = max(t * h * w for t, h, w in grids)
    return (*qkv.unbind(1), cu_seqlens_from_grid_thw(grids).cuda(), cos, sin, max_seqlen)


def run_kernel_case(vision_triton, name: str, dtype: torch.dtype) -> dict:
    q, k, v, cu_seqlens, cos, sin, max_seqlen = prepare_case(GRIDS[name], dtype)
    expected = naive.varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, cos, sin)
    poisoned = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    actual = vision_triton.varlen_attention(q, k, v, cu_seqlens, cos, sin, max_seqlen=max_seqlen, out=poisoned)
    error = relative_rms(actual.nan_to_num(), expected)
    unwritten = int(actual.isnan().sum())
    triton_ms = time_ms(lambda: vision_triton.varlen_attention(q, k, v, cu_seqlens, cos, sin, max_seqlen=max_seqlen))
    sdpa_ms = time_ms(lambda: sdpa.varlen_attention(q, k, v, cu_seqlens, cos, sin))
    return {"grids": name, "dtype": str(dtype).removeprefix("torch."), "relative_rms": error,
            "sdpa_relative_rms": relative_rms(sdpa.varlen_attention(q, k, v, cu_seqlens, cos, sin), expected),
            "unwritten": unwritten, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / triton_ms,
            "passed": error <= TOLERANCE[dtype] and unwritten == 0}


def run_cases() -> list[dict]:
    from moonserve.kernels.vision_attention import triton as vision_triton

    return [run_kernel_case(vision_triton, name, dtype) for name in GRIDS for dtype in TOLERANCE]


if __name__ == "__main__":
    sys.exit(gpu_check_main(__package__, run_cases))
