"""Patchify for MoonViT: resized uint8 RGB pixels -> padded, normalized [num_patches, 3, 14, 14] patches.

`naive` is the spec in plain torch (and the CPU path the ImagePreprocessor uses). The Triton fast
path lives in `moonserve.kernels.patchify.triton`, imported explicitly, so that this package imports on
machines without triton.
"""

from moonserve.kernels.patchify.naive import PATCH_SIZE, normalize_lut, patchify

__all__ = ["PATCH_SIZE", "normalize_lut", "patchify"]
