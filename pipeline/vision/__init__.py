"""The vision path: image sources and preprocessing (ImagePreprocessor), and the encoder side."""

from moonserve.pipeline.vision.errors import ImageError

__all__ = ["ImageError"]
