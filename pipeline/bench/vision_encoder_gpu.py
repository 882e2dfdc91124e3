"""MoonViT-V2 on a GPU: the Triton varlen attention kernel against SDPA inside the whole encoder.

MoonViT-V2 at the production config with seeded random weights in bfloat16, Triton against SDPA
attention on eight 448x448 images packed: relative RMS and images/s of each, and images/s of the
same images encoded one at a time (Triton). Prints one JSON object, as the kernels' GPU checks do;
the kernel on its own is `python -m moonserve.kernels.vision_attention.gpu_check`.

Run on a CUDA (or ROCm) machine:

    python -m moonserve.pipeline.bench.vision_encoder_gpu

Exit status: 0 if Triton and SDPA agree within tolerance, 1 if not, 2 without a GPU.
"""

from __future__ import annotations

import sys

import torch

from moonserve.kernels.checks import gpu_check_main, relative_rms, time_ms
from moonserve.pipeline.models.moonvit import MoonViT, MoonViTConfig
from moonserve.pipeline.prepare.vision_encoder import random_state_dict

GRIDS = [[1, 32, 32]] * 8  # eight 448x448 images
MODEL_TOLERANCE = 2e-2  # 27 bf16 layers, two attention paths that round differently


def build_model() -> MoonViT:
    """The production-size encoder with seeded random weights, bfloat16, on the GPU."""
    cfg = MoonViTConfig()
    model = MoonViT(cfg)
    model.load_state_dict(random_state_dict(cfg, seed=0))
    return model.to("cuda", torch.bfloat16).eval()


def run_model_case() -> dict:
    model = build_model()
    grids = GRIDS
    pixel_values = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, device="cuda")  # [8192, 3, 14, 14]
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
    return [run_model_case()]


if __name__ == "__main__":
    sys.exit(gpu_check_main(__package__, run_cases))
