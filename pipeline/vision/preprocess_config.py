"""How images are decoded, limited and laid out for MoonViT: `PreprocessConfig` and its defaults.

The standard library and pydantic's bound types only, so that `moonserve.pipeline.config`
(imported by the HTTP edge) can read these fields without importing Pillow, numpy or torch;
`pipeline/vision/preprocess.py` runs with the config. Each field (its type and bound, default and
description) is written here once: the YAML `vision.preprocessor` block's fields of the same
names (`ImagePreprocessorConfig`) are made from these.

Example:
    >>> PreprocessConfig(patch_size=16).merge_size
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import PositiveInt


def described(default, description: str):
    """A field with its default and the description the config reference shows for it."""
    return field(default=default, metadata={"description": description})


@dataclass(frozen=True)
class PreprocessConfig:
    """How images are decoded, limited and laid out for MoonViT.

    The layout fields mirror the checkpoint's `preprocessor_config.json` `media_proc_cfg`; the
    defaults are the public Kimi-K2.5 release values (vLLM itself ships none: it reads them from
    the checkpoint). `ImagePreprocessorConfig` (pipeline/config.py) takes its fields from here.
    """

    patch_size: PositiveInt = described(14, (
        "Side of one ViT patch, in pixels (KimiK3VisionConfig.patch_size)."))
    merge_kernel: tuple[PositiveInt, PositiveInt] = described((2, 2), (
        "Patches merged into one LM token, (rows, cols), square "
        "(KimiK3VisionConfig.merge_kernel_size)."))
    in_patch_limit: PositiveInt = described(16384, (
        "Most patches one image may have after the resize (media_proc_cfg.in_patch_limit): "
        "16384 patches = 4096 image tokens, about 3.2 megapixels."))
    patch_limit_on_one_side: PositiveInt = described(512, (
        "Most patches along either side (media_proc_cfg.patch_limit_on_one_side; 512 = "
        "7168 px); a multiple of the merge kernel's side."))
    image_mean: tuple[float, float, float] = described((0.5, 0.5, 0.5), (
        "Per-channel RGB mean subtracted after scaling to [0, 1] (media_proc_cfg.image_mean)."))
    image_std: tuple[float, float, float] = described((0.5, 0.5, 0.5), (
        "Per-channel RGB standard deviation the pixels are divided by after the mean "
        "(media_proc_cfg.image_std; each > 0)."))
    max_image_bytes: PositiveInt = described(20 * 1024 * 1024, (
        "Largest encoded image accepted, in bytes (checked before any parsing, and while a "
        "remote image downloads)."))
    max_image_pixels: PositiveInt = described(16_000_000, (
        "Largest decoded image accepted, width * height from the header (checked before "
        "decoding)."))
    background_rgb: tuple[int, int, int] = described((255, 255, 255), (
        "What transparent pixels are composited onto (vLLM's default rgba_background_color)."))

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_patch_limit", "patch_limit_on_one_side", "max_image_bytes",
                     "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"PreprocessConfig.{name} must be positive, got {getattr(self, name)}")
        check_merge_kernel(self.merge_kernel, self.patch_limit_on_one_side)
        check_normalization(self.image_mean, self.image_std)

    @property
    def merge_size(self) -> int:
        """Side of the (square) merge kernel, the scalar `navit_resize_image` takes."""
        return self.merge_kernel[0]


def check_merge_kernel(merge_kernel: tuple[int, int], patch_limit_on_one_side: int) -> None:
    rows, cols = merge_kernel
    if rows != cols or rows < 1:
        raise ValueError(f"PreprocessConfig.merge_kernel must be square and positive, got {merge_kernel}")
    # Otherwise padding can push a side past the limit (vLLM asserts on it).
    if patch_limit_on_one_side % rows:
        raise ValueError(
            f"PreprocessConfig.patch_limit_on_one_side ({patch_limit_on_one_side}) must be a multiple "
            f"of the merge kernel side ({rows})"
        )


def check_normalization(mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"PreprocessConfig.image_mean/image_std must be 3 values, std > 0; got {mean}, {std}")


DEFAULT_CONFIG = PreprocessConfig()
