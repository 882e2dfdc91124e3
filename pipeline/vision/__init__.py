"""The vision path: image sources and preprocessing (ImagePreprocessor), and the encoder side."""

from pipeline.vision.errors import ImageError

__all__ = ["ImageError"]
