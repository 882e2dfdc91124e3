"""VisionEncoder deployment: MoonViT-V2 over packed batches, with an embedding cache.

Concurrent `encode` calls (from all requests) are gathered by `serve.batch` and run as ONE packed
forward pass (all images in one sequence, attention restricted to each image by `cu_seqlens`).
Outputs are float32 arrays [num_image_tokens, text_hidden_size] returned through the object
store, and cached by the SHA-256 of the image bytes (LRU by bytes): an image seen before is not
encoded again, and concurrent requests for the same image share one encoding.

Example (without Serve):
    >>> encoder = VisionEncoder(VisionEncoderConfig(), model_path="/path/to/moonvit")
    >>> embeddings = await encoder.encode(info)         # ImageInfo from the ImagePreprocessor
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from ray import serve

from moonserve.pipeline.config import VisionEncoderConfig
from moonserve.pipeline.api.protocol import ImageInfo


def load_encoder(config: VisionEncoderConfig, model_path: str):
    import torch

    from moonserve.pipeline.models.moonvit_checkpoint import load_moonvit

    device = "cuda" if config.num_gpus and torch.cuda.is_available() else "cpu"
    return load_moonvit(model_path, dtype=getattr(torch, config.dtype), device=device,
                        attention_backend=config.attention_backend)


class VisionEncoder:
    def __init__(self, config: VisionEncoderConfig, model_path: str):
        from moonserve.pipeline.metrics import make_metric
        from moonserve.pipeline.vision.cache import EmbeddingCache

        self.model = load_encoder(config, model_path)
        self.cache = EmbeddingCache(config.cache_bytes)
        self.pending: dict[str, asyncio.Task] = {}  # encodings in progress, by image hash
        self.encode_batch.set_max_batch_size(config.max_batch_size)
        self.encode_batch.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        self.latency = make_metric("moonserve_image_encode_seconds")
        self.lookups = make_metric("moonserve_encoder_cache")

    async def encode(self, info: ImageInfo) -> np.ndarray:
        """[num_image_tokens, text_hidden_size] float32 for one preprocessed image."""
        cached = self.cache.get(info.content_hash)
        self.lookups.inc(tags={"result": "hit" if cached is not None else "miss"})
        if cached is not None:
            return cached
        task = self.pending.get(info.content_hash)
        if task is None:
            # The replica owns the encoding, not the request that started it: a caller that goes
            # away (client disconnect) does not fail the others waiting for the same image.
            task = asyncio.ensure_future(self.encode_and_cache(info))
            self.pending[info.content_hash] = task
            task.add_done_callback(lambda _: self.pending.pop(info.content_hash, None))
        return await asyncio.shield(task)

    async def encode_and_cache(self, info: ImageInfo) -> np.ndarray:
        embeddings = await self.encode_batch((await info.pixel_values, info.grid_thw))
        self.cache.put(info.content_hash, embeddings)
        return embeddings

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def encode_batch(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list:
        """One packed forward pass over every image of the batch, in a worker thread."""
        began = time.monotonic()
        outputs = await asyncio.to_thread(self.run_packed, items)
        elapsed = time.monotonic() - began
        for _ in items:
            self.latency.observe(elapsed)
        return outputs

    def run_packed(self, items) -> list[np.ndarray]:
        import torch

        param = next(self.model.parameters())
        pixel_values = torch.cat([torch.from_numpy(np.array(p)) for p, _ in items])  # [total, 3, 14, 14]
        grid_thw = [list(g) for _, g in items]
        with torch.inference_mode():
            outputs = self.model(pixel_values.to(param.device, param.dtype), grid_thw)
        return [o.float().cpu().numpy() for o in outputs]

    async def stats(self) -> dict[str, int]:
        return self.cache.stats()
