"""ImagePreprocessor building blocks: decode and validate bytes, NaViT resize, normalize, patchify.

The output is what MoonViT (Kimi-K3's vision tower) takes, identical to vLLM's own Kimi-K3 path
(`ImageMediaIO.load_bytes` then `KimiK25FusedVisionProcessor.preprocess`) for 8-bit images:

* sizes follow `navit_resize_image` (vllm/models/kimi_k3/common/mm_preprocess.py), reimplemented
  here so this module never imports vLLM;
* resize with Pillow BICUBIC to the NaViT size, pad bottom/right to a multiple of
  patch_size * merge with pixel 0, normalize (v / 255 - mean) * (1 / std), patchify row-major.

The sizes and limits are a `PreprocessConfig` (pipeline/vision/preprocess_config.py).

Example:

    >>> import io
    >>> from PIL import Image
    >>> buffer = io.BytesIO()
    >>> Image.new("RGB", (640, 480), (200, 30, 90)).save(buffer, format="PNG")
    >>> image = decode_image(buffer.getvalue())
    >>> out = preprocess(image)
    >>> out.pixel_values.shape, out.grid_thw, out.num_image_tokens
    (torch.Size([1656, 3, 14, 14]), (1, 36, 46), 414)
"""

from __future__ import annotations

import io
import math
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from moonserve.kernels.patchify import naive as patchify_naive
from moonserve.pipeline.vision.errors import IMAGE_TOO_LARGE, UNSUPPORTED_IMAGE, ImageError
from moonserve.pipeline.vision.preprocess_config import DEFAULT_CONFIG, PreprocessConfig

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow format names
SUPPORTED_NAMES = "PNG, JPEG, WebP, GIF, BMP"
# Magic numbers of the supported formats (WebP: "RIFF" <size> "WEBP", checked separately).
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
# Formats users do send, named in the rejection so the fix is obvious.
_UNSUPPORTED_MAGIC = (
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"%PDF", "PDF"),
    (b"<?xml", "SVG/XML"), (b"<svg", "SVG"),
)
# What Pillow raises on corrupt or truncated data, beyond OSError (which includes
# UnidentifiedImageError and "image file is truncated").
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
_TRANSPARENT_MODES = ("RGBA", "LA", "PA")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


@dataclass(frozen=True, eq=False)
class PreprocessedImage:
    """One image ready for MoonViT."""

    pixel_values: torch.Tensor  # [grid_h * grid_w, 3, patch, patch] float32, row-major patches
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches, padding included
    num_image_tokens: int  # grid_h * grid_w / (merge_h * merge_w): LM positions after the merge
    image_size: tuple[int, int]  # (width, height) decoded and oriented; the K3 prompt states it
    resized_size: tuple[int, int]  # (width, height) after the NaViT resize, before padding


def sniff_format(data: bytes) -> str:
    """Pillow format name of a supported image from its magic number; ImageError otherwise."""
    if not data:
        raise ImageError("image is empty (0 bytes)")
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    head = data[:256].lstrip()
    named = next((name for magic, name in _UNSUPPORTED_MAGIC if head.startswith(magic)), None)
    if named is None and data[4:8] == b"ftyp":
        named = "HEIC/AVIF"
    prefix = f"{named} images are not supported; send" if named else "not a supported image; send"
    raise ImageError(f"{prefix} {SUPPORTED_NAMES}", UNSUPPORTED_IMAGE)


def check_byte_size(data: bytes, cfg: PreprocessConfig) -> None:
    if len(data) > cfg.max_image_bytes:
        raise ImageError(
            f"image is {len(data):,} bytes, over the {cfg.max_image_bytes:,}-byte limit", IMAGE_TOO_LARGE
        )


def check_pixel_count(width: int, height: int, cfg: PreprocessConfig) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"image has zero width or height ({width}x{height})")
    if width * height > cfg.max_image_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height:,} pixels, over the "
            f"{cfg.max_image_pixels:,}-pixel limit", IMAGE_TOO_LARGE,
        )


def open_header(data: bytes, fmt: str, cfg: PreprocessConfig) -> Image.Image:
    """Image.open: reads the header only; no pixel is decoded yet."""
    try:
        return Image.open(io.BytesIO(data), formats=(fmt,))
    except Image.DecompressionBombError as exc:
        # Pillow refuses sizes over twice its own limit before we see the size ("Image size
        # (400000000 pixels) exceeds ..."); over its limit it only warns, and our lower cap follows.
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(declared[1]):,} pixels" if declared else "a decompression-bomb size"
        raise ImageError(f"image is {size}, over the {cfg.max_image_pixels:,}-pixel limit", IMAGE_TOO_LARGE) from None
    except _DECODE_ERRORS:
        raise ImageError(f"corrupt {fmt} file (its header cannot be read)") from None


def load_pixels(image: Image.Image, fmt: str) -> None:
    """Decode the (first frame's) pixels; truncated data is an error, never padded with grey."""
    try:
        image.load()
    except _DECODE_ERRORS as exc:
        truncated = "truncated" in str(exc).lower()
        raise ImageError(f"truncated {fmt} file" if truncated else f"corrupt {fmt} file") from None


def apply_exif_orientation(image: Image.Image) -> Image.Image:
    """Rotate/flip as the EXIF Orientation tag says, so pixels match what viewers display."""
    try:
        ImageOps.exif_transpose(image, in_place=True)  # in place: no copy when there is no tag
    except _DECODE_ERRORS:
        pass  # a malformed EXIF block leaves the pixels usable; viewers show them unrotated too
    return image


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Any decoded mode -> RGB, as vLLM's ImageMediaIO does except for 16-bit grey.

    Transparency (RGBA, LA, PA, or a palette/grey tRNS key) is composited onto `background`.
    16-bit grey keeps its top 8 bits (Pillow's own convert clips everything over 255 to white).
    """
    if image.mode == "RGB":
        return image
    if image.mode in _SIXTEEN_BIT_MODES:
        grey = (np.asarray(image).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)  # [H, W]
        return Image.fromarray(grey, "L").convert("RGB")
    if image.mode in _TRANSPARENT_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, background)
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")  # L, 1, P, CMYK, ...


def decode_image(data: bytes, cfg: PreprocessConfig = DEFAULT_CONFIG) -> Image.Image:
    """Encoded bytes (PNG, JPEG, WebP, GIF, BMP) -> an oriented RGB Pillow image.

    Checks, in order, so that nothing big is decoded before it is known to fit: the byte limit,
    the format (magic number), the header's width * height against `max_image_pixels`, then the
    decode itself (truncated files are rejected). Animated GIF/WebP/PNG give their first frame.
    Raises ImageError with a user-facing `reason`.

    >>> decode_image(b"GIF89a not really").size
    Traceback (most recent call last):
    ...
    moonserve.pipeline.vision.errors.ImageError: corrupt GIF file (its header cannot be read)
    """
    check_byte_size(data, cfg)
    fmt = sniff_format(data)
    image = open_header(data, fmt, cfg)
    check_pixel_count(*image.size, cfg)
    load_pixels(image, fmt)
    return to_rgb(apply_exif_orientation(image), cfg.background_rgb)


def navit_size(width: int, height: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """(width, height) after the NaViT resize, before padding; exactly vLLM's navit_resize_image.

    Scales down (never up) by one factor: to about `in_patch_limit` whole patches (counted on the
    original size, so the padded result can exceed it: 4000x3000 gives 16,800 patches) and to at
    most `patch_limit_on_one_side` patches along either side. The float arithmetic is vLLM's, term
    for term, so the truncations agree (1x100000 gives 7167, not 7168).

    >>> navit_size(4000, 3000), navit_size(1, 100000), navit_size(27, 29)
    ((2073, 1554), (1, 7167), (27, 29))
    """
    if width < 1 or height < 1:
        raise ImageError(f"image has zero width or height ({width}x{height})")
    patch, side_limit = cfg.patch_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    s2 = side_limit * patch / width
    s3 = side_limit * patch / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), side_limit * patch)
    new_h = min(max(1, int(height * scale)), side_limit * patch)
    return new_w, new_h


def navit_grid(width: int, height: int, cfg: PreprocessConfig = DEFAULT_CONFIG) -> tuple[int, int, int]:
    """grid_thw (1, grid_h, grid_w) in patches of an image of this ORIGINAL size, padding included.

    Both sides are padded up to a multiple of patch_size * merge, so grid_h and grid_w are
    multiples of the merge kernel.

    >>> navit_grid(640, 480), navit_grid(1, 1)
    ((1, 36, 46), (1, 2, 2))
    """
    new_w, new_h = navit_size(width, height, cfg)
    factor = cfg.patch_size * cfg.merge_size
    grid_h = -(-new_h // factor) * cfg.merge_size
    grid_w = -(-new_w // factor) * cfg.merge_size
    return 1, grid_h, grid_w


def num_image_tokens(grid_thw: tuple[int, int, int], cfg: PreprocessConfig = DEFAULT_CONFIG) -> int:
    """LM positions of an image: its patches after the merge kernel folds them."""
    t, grid_h, grid_w = grid_thw
    rows, cols = cfg.merge_kernel
    return t * (grid_h // rows) * (grid_w // cols)


def preprocess(image: Image.Image, cfg: PreprocessConfig = DEFAULT_CONFIG) -> PreprocessedImage:
    """An RGB image (from decode_image) -> pixel_values [num_patches, 3, 14, 14] float32 and grid_thw.

    Resizes with Pillow BICUBIC (vLLM's choice) to navit_size, then pads, normalizes and
    patchifies with moonserve.kernels.patchify.naive (the CPU path).
    """
    if image.mode != "RGB":
        raise ValueError(f"preprocess needs an RGB image (decode_image gives one), got mode {image.mode}")
    new_w, new_h = navit_size(*image.size, cfg)
    grid_thw = navit_grid(*image.size, cfg)
    resized = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.array(resized))  # [new_h, new_w, 3] uint8 (a writable copy)
    pixel_values = patchify_naive.patchify(pixels, grid_thw[1:], cfg.image_mean, cfg.image_std, cfg.patch_size)
    return PreprocessedImage(pixel_values, grid_thw, num_image_tokens(grid_thw, cfg), image.size, (new_w, new_h))
