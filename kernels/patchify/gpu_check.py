"""GPU check of the patchify Triton kernel against moonserve.kernels.patchify.naive; prints one JSON object.

Run from the repository root on a CUDA machine (as a module, so that ``import triton`` finds the
real triton and not kernels/patchify/triton.py):

    python -m moonserve.kernels.patchify.gpu_check

For each image size and output dtype it reports whether the kernel is bit-exact with the naive
torch path run on the CPU (what vLLM's CPU processor gives), unwritten elements (NaN-poisoned output), and the median time of
the fused kernel against the naive path, with the kernel's effective bandwidth. Exit status: 0 if
every case is bit-exact and fully written, 1 if any is not, 2 without a CUDA device.
"""

from __future__ import annotations

import sys

import torch

from moonserve.kernels.checks import gpu_check_main, time_ms
from moonserve.kernels.patchify import naive

# (H, W) of resized images: odd sides; 4000x3000 after the NaViT resize; the largest NaViT image.
SIZES = [(1823, 781), (1554, 2073), (7168, 7168)]
DTYPES = [torch.float32, torch.bfloat16]
MEAN = (0.48145466, 0.4578275, 0.40821073)  # uneven constants catch channel mix-ups
STD = (0.26862954, 0.26130258, 0.27577711)


def grid_for(height: int, width: int, factor: int = 28) -> tuple[int, int]:
    """Patch grid padded to a multiple of the 2x2 merge (28 pixels), as the NaViT rules give."""
    return -(-height // factor) * 2, -(-width // factor) * 2


def run_case(patchify_triton, height: int, width: int, dtype: torch.dtype) -> dict:
    generator = torch.Generator("cuda").manual_seed(0)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, device="cuda", generator=generator)
    grid_hw = grid_for(height, width)
    expected = naive.patchify(pixels.cpu(), grid_hw, MEAN, STD, dtype=dtype).cuda()  # the CPU spec (= vLLM's)
    poisoned = torch.full(expected.shape, float("nan"), dtype=dtype, device="cuda")
    actual = patchify_triton.patchify(pixels, grid_hw, MEAN, STD, dtype=dtype, out=poisoned)
    unwritten = int(actual.isnan().sum())
    bit_exact = torch.equal(actual, expected)
    triton_ms = time_ms(lambda: patchify_triton.patchify(pixels, grid_hw, MEAN, STD, dtype=dtype, out=poisoned))
    naive_ms = time_ms(lambda: naive.patchify(pixels, grid_hw, MEAN, STD, dtype=dtype))
    moved_bytes = pixels.numel() + expected.numel() * expected.element_size()
    return {"height": height, "width": width, "grid_hw": list(grid_hw), "dtype": str(dtype).removeprefix("torch."),
            "bit_exact": bit_exact, "unwritten": unwritten, "passed": bit_exact and unwritten == 0,
            "triton_ms": triton_ms, "naive_ms": naive_ms, "speedup": naive_ms / triton_ms,
            "triton_gb_per_s": moved_bytes / triton_ms / 1e6}


def run_cases() -> list[dict]:
    from moonserve.kernels.patchify import triton as patchify_triton

    return [run_case(patchify_triton, *size, dtype) for size in SIZES for dtype in DTYPES]


if __name__ == "__main__":
    sys.exit(gpu_check_main(__package__, run_cases))
