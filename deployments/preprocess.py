"""ImagePreprocessor deployment: image URL -> patches in the object store + their layout.

Sources are `data:image/...;base64,` URLs, and `http(s)` URLs only for allow-listed hosts
(pipeline/vision/sources.py: DNS-pinned, private ranges refused, byte cap while streaming).
Decoding and patchify run in a worker thread, batched across concurrent requests with
`serve.batch`, so the replica's event loop keeps taking requests. Bad images raise
`ImageError`; the router answers 400 naming the message and part.

Example (without Serve):
    >>> pre = ImagePreprocessor(ImagePreprocessorConfig())
    >>> info = await pre.preprocess("data:image/png;base64,...")   # ImageInfo
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from ray import serve

from moonserve.pipeline.config import ImagePreprocessorConfig
from moonserve.pipeline.api.protocol import ImageInfo


def decode_and_patchify(data: bytes, cfg):
    """bytes -> (pixel_values float32 ndarray [num_patches, 3, 14, 14], PreprocessedImage)."""
    from moonserve.pipeline.vision.preprocess import decode_image, preprocess

    image = preprocess(decode_image(data, cfg), cfg)
    return image.pixel_values.numpy(), image


def decode_and_count(data: bytes, cfg):
    """bytes -> (RGB PIL image, grid_thw, num_image_tokens): the layout without the patches."""
    from moonserve.pipeline.vision.preprocess import decode_image, navit_grid, num_image_tokens

    image = decode_image(data, cfg)
    grid_thw = navit_grid(*image.size, cfg)
    return image, grid_thw, num_image_tokens(grid_thw, cfg)


class ImagePreprocessor:
    """`decoded_only` (vision.handover encoder_cache): images are decoded, checked and counted,
    and the decoded image goes to the object store instead of patches (vLLM's processor
    patchifies for the model)."""

    def __init__(self, config: ImagePreprocessorConfig, decoded_only: bool = False):
        self.cfg = config.preprocess_config()
        self.decoded_only = decoded_only
        self.policy = config.remote
        self.session = None
        self.process_batch.set_max_batch_size(config.max_batch_size)
        self.process_batch.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        from moonserve.pipeline.metrics import make_metric

        self.latency = make_metric("moonserve_image_preprocess_seconds")

    async def preprocess(self, url: str) -> ImageInfo:
        import ray

        began = time.monotonic()
        data = await self.read_source(url)
        result = await self.process_batch(data)
        if isinstance(result, Exception):
            raise result
        self.latency.observe(time.monotonic() - began)
        content_hash = hashlib.sha256(data).hexdigest()
        if self.decoded_only:
            image, grid_thw, num_tokens = result
            return ImageInfo(content_hash=content_hash, grid_thw=tuple(grid_thw),
                             num_image_tokens=num_tokens, image_size=image.size,
                             pixel_values=None, image=ray.put(image))
        pixels, image = result
        return ImageInfo(content_hash=content_hash,
                         grid_thw=tuple(image.grid_thw), num_image_tokens=image.num_image_tokens,
                         image_size=tuple(image.image_size), pixel_values=ray.put(pixels))

    async def ready(self) -> bool:
        """Answers while the replica's event loop runs (the router's /health asks)."""
        return True

    async def read_source(self, url: str) -> bytes:
        from moonserve.pipeline.vision.sources import fetch_remote, parse_data_url

        if url.startswith("data:"):
            return parse_data_url(url, self.cfg.max_image_bytes)
        return await fetch_remote(url, self.policy, await self.http(), self.cfg.max_image_bytes)

    async def http(self):
        import aiohttp

        if self.session is None:
            # No cookies: one user's fetch must not carry state into another's.
            self.session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        return self.session

    # Two batches at once: Pillow releases the GIL while decoding and resizing, so a replica
    # with 2 CPUs decodes on both.
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002, max_concurrent_batches=2)
    async def process_batch(self, items: list[bytes]) -> list:
        """Decode a batch in one worker thread; a bad image fails only its own request."""
        return await asyncio.to_thread(lambda: [self.process_one(data) for data in items])

    def process_one(self, data: bytes):
        """A failure is returned, not raised, so it fails only its own request."""
        try:
            return (decode_and_count if self.decoded_only else decode_and_patchify)(data, self.cfg)
        except Exception as exc:
            return exc
