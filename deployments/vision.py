"""VisionEncoder deployment: MoonViT-V2 over packed batches, with an embedding cache; or, with
`vision.handover: encoder_cache`, the LM checkpoint's own vision tower in an encoder-only vLLM
engine (`EngineVisionEncoder`).

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

from moonserve.pipeline.config import EngineConfig, VisionEncoderConfig
from moonserve.pipeline.api.protocol import ImageInfo, StoredEncoding


async def shared_encoding(pending: dict[str, asyncio.Task], key: str, encode):
    """One encoding per image at a time: the task in progress for `key`, else a new one from
    `encode()`. The replica owns it, not the request that started it: a caller that goes away
    (client disconnect) does not fail the others waiting for the same image."""
    task = pending.get(key)
    if task is None:
        task = asyncio.ensure_future(encode())
        pending[key] = task
        task.add_done_callback(lambda _: pending.pop(key, None))
    return await asyncio.shield(task)


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
        return await shared_encoding(self.pending, info.content_hash,
                                     lambda: self.encode_and_cache(info))

    async def encode_and_cache(self, info: ImageInfo) -> np.ndarray:
        # A copy, not the zero-copy view of the preprocessor's object: Serve's batch loop keeps
        # its last batch's arguments until the next batch, and a view would pin that object in
        # the object store as long (`moonserve bench soak` found it).
        pixels = np.array(await info.pixel_values)
        embeddings = await self.encode_batch((pixels, info.grid_thw))
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
        pixel_values = torch.cat([torch.from_numpy(p) for p, _ in items])  # [total, 3, 14, 14]
        grid_thw = [list(g) for _, g in items]
        with torch.inference_mode():
            outputs = self.model(pixel_values.to(param.device, param.dtype), grid_thw)
        return [o.float().cpu().numpy() for o in outputs]

    async def stats(self) -> dict[str, int]:
        return self.cache.stats()


def encoder_engine_args(config: VisionEncoderConfig, engine: EngineConfig, model_path: str,
                        modality: str):
    """An encoder-only vLLM engine on the LM checkpoint (`mm_encoder_only`: no language model
    weights, no KV cache) that stores each image's output through `MoonserveECConnector`."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from moonserve.pipeline.engine.ec_connector import ec_transfer_config

    return AsyncEngineArgs(
        model=model_path, tokenizer=model_path, dtype=engine.dtype,
        max_model_len=engine.max_model_len, trust_remote_code=engine.trust_remote_code,
        enforce_eager=engine.enforce_eager, seed=engine.seed,
        max_num_seqs=config.max_batch_size, gpu_memory_utilization=config.gpu_memory_utilization,
        mm_encoder_tp_mode=engine.mm_encoder_tp_mode, limit_mm_per_prompt={modality: 1},
        mm_encoder_only=True,
        ec_transfer_config=ec_transfer_config("ec_producer", config.store, config.store_max_bytes),
    )


class EngineVisionEncoder:
    """The VisionEncoder with `vision.handover: encoder_cache`.

    Each image is one request to an encoder-only vLLM engine (`ec_producer`) whose prompt is the
    model's placeholder text, with the image's SHA-256 as its `multi_modal_uuids` (the key the
    LanguageModel sends too); the engine stops it once the image is encoded, and its connector has
    stored the output in `config.store` under vLLM's hash of that item (`ImageFormat.store_keys`:
    the uuid while requests carry no processor kwargs). Concurrent requests are batched by the
    engine itself. An image already in the store is not encoded again, and concurrent requests for
    one image share one encoding. `encode` returns a `StoredEncoding`: the output's rows, and
    where it is stored (this node, `config.store`); nothing is put in Ray's object store
    (a LanguageModel on another node fetches the entry from here, `ec_store.fetch_from`).
    """

    def __init__(self, config: VisionEncoderConfig, engine: EngineConfig, model_path: str):
        import ray
        from vllm.v1.engine.async_llm import AsyncLLM

        from moonserve.pipeline.engine.image_format import image_format
        from moonserve.pipeline.metrics import make_metric

        self.store = config.store
        self.format = image_format(model_path)
        self.engine = AsyncLLM.from_engine_args(
            encoder_engine_args(config, engine, model_path, self.format.modality))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.pending: dict[str, asyncio.Task] = {}
        self.counts = {"hits": 0, "misses": 0, "encoded": 0}
        self.latency = make_metric("moonserve_image_encode_seconds")
        self.lookups = make_metric("moonserve_encoder_cache")

    async def encode(self, info: ImageInfo) -> StoredEncoding:
        from moonserve.pipeline.engine.ec_store import has, num_rows

        uuid = info.content_hash
        [key] = self.format.store_keys([uuid], self.engine.model_config)
        hit = has(self.store, key)
        self.counts["hits" if hit else "misses"] += 1
        self.lookups.inc(tags={"result": "hit" if hit else "miss"})
        if not hit:
            await shared_encoding(self.pending, key, lambda: self.run_engine(info, key))
        rows = await asyncio.to_thread(num_rows, self.store, key)
        return StoredEncoding(rows, self.node_id, self.store)

    async def run_engine(self, info: ImageInfo, key: str) -> None:
        """Encode `info`'s image; its output is then in the store under `key`."""
        import uuid

        from vllm import SamplingParams

        from moonserve.pipeline.engine.ec_store import has

        prompt = {"prompt": self.format.placeholder_text,
                  **self.format.multi_modal([await info.image], [info.content_hash])}
        began = time.monotonic()
        async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1),
                                            f"encode-{key[:16]}-{uuid.uuid4().hex[:8]}"):
            pass
        self.latency.observe(time.monotonic() - began)
        self.counts["encoded"] += 1
        if not has(self.store, key):
            raise RuntimeError(f"image {key[:16]}: the encoder engine finished without storing "
                               f"its output in {self.store}")

    async def stats(self) -> dict[str, int]:
        """Store lookups (`hits`, `misses`) and engine encodings (`encoded`) since start."""
        await self.engine.check_health()
        return dict(self.counts)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
