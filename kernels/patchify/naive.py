"""Patchify in plain torch: a resized uint8 RGB image -> normalized patches for MoonViT (Kimi-K3).

The spec the fast paths are tested against; it reproduces vLLM's ``KimiK25FusedVisionProcessor``
(the image processor vLLM uses for Kimi-K3) bit for bit:

* the image ``[H, W, 3]`` is padded on the bottom and right up to ``[grid_h * P, grid_w * P]`` with
  pixel value 0 *before* normalization, so padding becomes ``(0 - mean) / std`` (-1.0 for the Kimi
  mean = std = 0.5), not 0.0;
* a value v of channel c becomes ``(v / 255 - mean[c]) * (1 / std[c])`` in float32 (a multiply by
  the float32 reciprocal of std, as vLLM does, not a divide);
* patches come in row-major order of the patch grid (index = row * grid_w + col), each one
  ``[3, P, P]`` (channels first). MoonViT merges 2x2 neighbours itself; no reordering here.

Example:

    >>> import torch
    >>> pixels = torch.full((20, 30, 3), 255, dtype=torch.uint8)  # [H, W, 3]
    >>> patches = patchify(pixels, (2, 4), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    >>> patches.shape  # [grid_h * grid_w, 3, 14, 14]
    torch.Size([8, 3, 14, 14])
    >>> patches[0, 0, 0, 0].item(), patches[7, 2, 13, 13].item()  # an image pixel, a padding pixel
    (1.0, -1.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

PATCH_SIZE = 14
NUM_CHANNELS = 3


def check_inputs(pixels: torch.Tensor, grid_hw: tuple[int, int], patch_size: int) -> None:
    """Raise a ValueError naming the shapes unless pixels is uint8 [H, W, 3] and fits the grid."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != NUM_CHANNELS:
        raise ValueError(f"patchify needs uint8 pixels [H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}")
    grid_h, grid_w = grid_hw
    height, width = pixels.shape[:2]
    if not (0 < height <= grid_h * patch_size and 0 < width <= grid_w * patch_size):
        raise ValueError(
            f"patchify: image {height}x{width} (HxW) does not fit a {grid_h}x{grid_w} grid of "
            f"{patch_size}-pixel patches"
        )


def normalize_lut(mean: Sequence[float], std: Sequence[float], device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [256, 3]: the normalized value of each uint8 value in each channel."""
    values = torch.arange(256, dtype=torch.float32, device=device)[:, None]  # [256, 1]
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device)  # [3]
    inv_std = 1.0 / torch.tensor(std, dtype=torch.float32, device=device)  # [3]
    return (values / 255.0 - mean_t) * inv_std


def patchify(
    pixels: torch.Tensor,
    grid_hw: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    patch_size: int = PATCH_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 pixels [H, W, 3] -> normalized patches [grid_h * grid_w, 3, P, P] in dtype.

    Computed in float32, then cast. ``grid_hw`` is the padded grid in patches (from the NaViT rules).
    """
    check_inputs(pixels, grid_hw, patch_size)
    grid_h, grid_w = grid_hw
    height, width = pixels.shape[:2]
    padded = F.pad(pixels, (0, 0, 0, grid_w * patch_size - width, 0, grid_h * patch_size - height))
    tiles = padded.view(grid_h, patch_size, grid_w, patch_size, NUM_CHANNELS)
    # Reorder as uint8 (a quarter of the bytes), then normalize in place: 2-3x faster on CPU.
    tiles = tiles.permute(0, 2, 4, 1, 3).reshape(-1, NUM_CHANNELS, patch_size, patch_size)  # [N, 3, P, P]
    mean_t = torch.tensor(mean, dtype=torch.float32, device=pixels.device).view(3, 1, 1)
    inv_std = 1.0 / torch.tensor(std, dtype=torch.float32, device=pixels.device).view(3, 1, 1)
    normalized = tiles.float().div_(255.0).sub_(mean_t).mul_(inv_std)
    return normalized.to(dtype)
