"""The image path's replica code: sources and preprocessing (ImagePreprocessor), the embedding
cache (VisionEncoder); the MoonViT model is `moonserve.pipeline.models.moonvit`."""

from moonserve.pipeline.vision.errors import ImageError

__all__ = ["ImageError"]
