"""GPU check of the varlen rotary attention kernel and of MoonViT-V2 on it; prints one JSON object.

Run from the repository root on a CUDA (or ROCm) machine, as a module so that ``import triton``
finds the real triton and not kernels/vision_attention/triton.py:

    python -m moonserve.kernels.vision_attention.gpu_check

Kernel cases (12 heads of 128, as MoonViT-V2), float32 and bfloat16: relative-RMS error of the
Triton kernel against moonserve.kernels.vision_attention.naive in float32 on the same inputs, unwritten
(NaN-poisoned) outputs, and the median time of the Triton kernel against the SDPA torch path.
Model case: MoonViT-V2 at the production config with seeded random weights in bfloat16, Triton
against SDPA attention on eight 448x448 images packed: relative RMS and images/s of each, and
images/s of the same images encoded one at a time (Triton).
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
MODEL_TOLERANCE = 2e-2  # 27 bf16 layers, two attention paths that round differently


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


def run_model_case() -> dict:
    from moonserve.pipeline.prepare.vision_encoder import random_state_dict
    from moonserve.pipeline.models.moonvit import MoonViT, MoonViTConfig

    cfg = MoonViTConfig()
    model = MoonViT(cfg)
    model.load_state_dict(random_state_dict(cfg, seed=0))
    model = model.to("cuda", torch.bfloat16).eval()
    grids = GRIDS["8x448px"]
    pixel_values = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, device="cuda")
    results = {}
    with torch.inference_mode():
        for backend in ("sdpa", "triton"):
            model.attention_backend = backend
            results[backend] = torch.cat(model(pixel_values, grids))
            ms = time_ms(lambda: model.embed_packed(pixel_values, grids), warmup=2, iters=10)
            results[f"{backend}_images_per_s"] = len(grids) / ms * 1000
        images = pixel_values.split([t * h * w for t, h, w in grids])
        loop_ms = time_ms(lambda: [model.embed_packed(x, [g]) for x, g in zip(images, grids)], warmup=2, iters=10)
    error = relative_rms(results["triton"], results["sdpa"])
    return {"grids": "8x448px", "dtype": "bfloat16", "triton_vs_sdpa_relative_rms": error,
            "triton_images_per_s": results["triton_images_per_s"], "sdpa_images_per_s": results["sdpa_images_per_s"],
            "triton_per_image_loop_images_per_s": len(grids) / loop_ms * 1000,
            "passed": error <= MODEL_TOLERANCE and bool(results["triton"].isfinite().all())}


def run_cases() -> list[dict]:
    from moonserve.kernels.vision_attention import triton as vision_triton

    kernel_cases = [run_kernel_case(vision_triton, name, dtype) for name in GRIDS for dtype in TOLERANCE]
    return kernel_cases + [run_model_case()]


if __name__ == "__main__":
    sys.exit(gpu_check_main(__package__, run_cases))
