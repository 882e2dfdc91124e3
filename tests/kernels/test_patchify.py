"""Patchify: the naive spec against a hand-written loop, and Triton (interpreter) against naive."""

from __future__ import annotations

import doctest

import pytest
import torch

from moonserve.kernels.checks import relative_rms
from moonserve.kernels.patchify import naive
from moonserve.kernels.patchify.naive import patchify

KIMI_MEAN = (0.5, 0.5, 0.5)
KIMI_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # uneven per-channel constants catch channel mix-ups
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def random_pixels(height: int, width: int, seed: int) -> torch.Tensor:
    """uint8 [H, W, 3] covering all 256 values."""
    return torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def loop_patchify(pixels: torch.Tensor, grid_hw: tuple[int, int], mean, std, patch: int = 14) -> torch.Tensor:
    """The layout written out element by element, independent of naive's reshapes."""
    grid_h, grid_w = grid_hw
    out = torch.empty(grid_h * grid_w, 3, patch, patch)
    for index in range(grid_h * grid_w):
        row, col = divmod(index, grid_w)
        for c in range(3):
            for py in range(patch):
                for px in range(patch):
                    y, x = row * patch + py, col * patch + px
                    inside = y < pixels.shape[0] and x < pixels.shape[1]
                    value = torch.tensor(float(pixels[y, x, c]) if inside else 0.0)
                    scaled = value.float() / 255.0
                    out[index, c, py, px] = (scaled - mean[c]) * (1.0 / torch.tensor(std[c]))
    return out


def test_docstring_examples_run():
    assert doctest.testmod(naive).failed == 0


@pytest.mark.parametrize("height, width, grid_hw", [(29, 27, (4, 2)), (1, 1, (2, 2)), (14, 30, (2, 4))])
def test_naive_matches_the_element_loop(height, width, grid_hw):
    pixels = random_pixels(height, width, seed=height)
    expected = loop_patchify(pixels, grid_hw, CLIP_MEAN, CLIP_STD)
    assert torch.equal(patchify(pixels, grid_hw, CLIP_MEAN, CLIP_STD), expected)


def test_padding_is_normalized_zero_not_zero():
    pixels = torch.full((15, 15, 3), 255, dtype=torch.uint8)
    patches = patchify(pixels, (2, 2), KIMI_MEAN, KIMI_STD)  # [4, 3, 14, 14]
    assert patches[0].eq(1.0).all()  # fully inside
    assert patches[3, :, 0, 0].eq(1.0).all() and patches[3, :, 1, 1].eq(-1.0).all()  # (14, 14) in, (15, 15) padding
    assert patches[1, :, :, 1:].eq(-1.0).all()  # columns 15.. of the first patch row are padding


def test_every_value_normalizes_to_its_lut_entry():
    lut = naive.normalize_lut(CLIP_MEAN, CLIP_STD)  # [256, 3]
    pixels = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 3).contiguous()  # [1, 256, 3]
    patches = patchify(pixels, (2, 20), CLIP_MEAN, CLIP_STD)  # first patch row holds x = 0..279
    for c in range(3):
        assert torch.equal(patches[:20, c, 0, :].flatten()[:256], lut[:, c])


@pytest.mark.parametrize(
    "pixels, grid_hw, match",
    [
        (torch.zeros(4, 4, 3), (2, 2), "uint8 pixels"),
        (torch.zeros(4, 4, 4, dtype=torch.uint8), (2, 2), r"\(4, 4, 4\)"),
        (torch.zeros(29, 4, 3, dtype=torch.uint8), (2, 2), "29x4"),
        (torch.zeros(0, 4, 3, dtype=torch.uint8), (2, 2), "0x4"),
    ],
)
def test_bad_inputs_name_the_shape(pixels, grid_hw, match):
    with pytest.raises(ValueError, match=match):
        patchify(pixels, grid_hw, KIMI_MEAN, KIMI_STD)


# The Triton cases run in a TRITON_INTERPRET=1 child (conftest.py: `triton_results`). Shapes: odd
# sides, a 1-pixel image, an extreme aspect ratio (NaViT's 1x100000 -> 1x7167), and an image
# exactly filling its grid. Only float32: the interpreter's float32 -> bf16 cast truncates instead
# of rounding to nearest even (measured: relative RMS 2.5e-3 against torch's cast); gpu_check.py
# covers bf16 on a GPU.
TRITON_CASES = [
    ((1823, 781), (132, 56), "float32"),
    ((1, 1), (2, 2), "float32"),
    ((7167, 1), (512, 2), "float32"),
    ((28, 56), (2, 4), "float32"),
    ((63, 45), (6, 4), "float32"),
]


def run_triton_case(patchify_triton, size: tuple[int, int], grid_hw: tuple[int, int], dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    pixels = random_pixels(*size, seed=size[0])
    expected = patchify(pixels, grid_hw, CLIP_MEAN, CLIP_STD, dtype=dtype)
    poisoned = torch.full(expected.shape, float("nan"), dtype=dtype)  # unwritten elements stay NaN
    actual = patchify_triton.patchify(pixels, grid_hw, CLIP_MEAN, CLIP_STD, dtype=dtype, out=poisoned)
    return {
        "unwritten": int(actual.isnan().sum()),
        "bit_exact": torch.equal(actual, expected),
        "relative_rms": relative_rms(actual.nan_to_num(), expected),
    }


def run_triton_cases() -> dict:
    """Entry point of the TRITON_INTERPRET=1 child: every Triton case, as JSON-able results."""
    from triton.runtime.interpreter import InterpretedFunction

    from moonserve.kernels.patchify import triton as patchify_triton

    return {
        "interpreted": isinstance(patchify_triton._patchify_kernel, InterpretedFunction),
        "cases": {str(case): run_triton_case(patchify_triton, *case) for case in TRITON_CASES},
    }


def test_triton_kernel_runs_in_the_interpreter(triton_results):
    assert triton_results["interpreted"]


@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_patchify_matches_naive(triton_results, case):
    result = triton_results["cases"][str(case)]
    assert result["unwritten"] == 0
    assert result["relative_rms"] <= 1e-7
    assert result["bit_exact"]


def test_triton_wrapper_rejects_what_naive_rejects():
    # Checks happen before any launch, so this runs in this process, interpreter or not.
    patchify_triton = pytest.importorskip("moonserve.kernels.patchify.triton", reason="triton is not installed")
    with pytest.raises(ValueError, match="29x4"):
        patchify_triton.patchify(torch.zeros(29, 4, 3, dtype=torch.uint8), (2, 2), KIMI_MEAN, KIMI_STD)
    with pytest.raises(ValueError, match="out must be"):
        patchify_triton.patchify(torch.zeros(4, 4, 3, dtype=torch.uint8), (2, 2), KIMI_MEAN, KIMI_STD,
                                 out=torch.empty(4, 3, 14, 13))
