"""The encoder-output handover of `moonserve.pipeline.engine.ec_connector` on real vLLM CPU engines.

One tiny Kimi-K2.5 checkpoint with random weights (`synthetic_checkpoints.k25`) and two engines,
each started, used and shut down inside its own fixture, so never two at once: an `ec_producer`
writing a tmp store, and an `ec_consumer` reading it. The key properties: the rows the consumer's language model
gets at the image positions are the stored tensor, and bit-equal to what the consumer computes
from the pixels itself when the key is not stored (so a handed-over image is exactly an image
encoded in the engine); a miss still serves the request. `EngineProbe` (a vLLM worker extension)
counts vision tower calls and records each prefill's `inputs_embeds` inside the worker process.
The same path in a running app (the VisionEncoder as the producer):
tests/engines/test_encoder_cache_app.py. The store's own rules (atomic put, LRU eviction, key
checks): tests/unit/test_ec_store.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from moonserve.pipeline.engine.ec_connector import ec_transfer_config
from moonserve.pipeline.engine.ec_store import get, store_path
from moonserve.pipeline.synthetic_checkpoints.k3 import token_id
from moonserve.pipeline.synthetic_checkpoints.k25 import IMAGE_PLACEHOLDER, write_k25_checkpoint

KEY = "k25-gradient"  # the request's multi_modal_uuids entry: the store's key
SAME_KEY = "k25-gradient-again"  # the same image under a key nothing stored
OTHER_KEY = "k25-other-gradient"
PROMPT = (f"<|im_user|>user<|im_middle|>{IMAGE_PLACEHOLDER}describe<|im_end|>"
          "<|im_assistant|>assistant<|im_middle|>")
MEDIA_PAD = token_id("<|media_pad|>")
ENGINE_ARGS = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 2048,
               "max_num_seqs": 2, "seed": 0, "limit_mm_per_prompt": {"vision_chunk": 1},
               "worker_extension_cls": f"{__name__}.EngineProbe"}


class EngineProbe:
    """Worker extension (vLLM's `worker_extension_cls`; methods called by `collective_rpc`)."""

    def install_probe(self) -> None:
        model = self.model_runner.get_model()
        self.probe = {"vision_calls": 0, "prefills": []}
        model.vision_tower.register_forward_hook(self.count_vision_call)
        model.register_forward_pre_hook(self.record_prefill, with_kwargs=True)

    def count_vision_call(self, module, args, output) -> None:
        self.probe["vision_calls"] += 1

    def record_prefill(self, module, args, kwargs) -> None:
        inputs_embeds = kwargs.get("inputs_embeds")  # [num_tokens, hidden]
        if inputs_embeds is not None and inputs_embeds.shape[0] > 1:  # decode steps are 1 token
            self.probe["prefills"].append(inputs_embeds.detach().float().cpu())

    def probe_report(self) -> dict:
        """Vision calls and prefills since the last report; the rows as float lists (exact for
        bfloat16), which is what the engine's RPC reply carries unchanged."""
        report, self.probe = self.probe, {"vision_calls": 0, "prefills": []}
        return {"vision_calls": report["vision_calls"],
                "prefills": [rows.tolist() for rows in report["prefills"]]}


@dataclass
class Result:
    prompt_token_ids: list[int]
    vision_calls: int
    image_rows: torch.Tensor | None  # [num_image_tokens, hidden] float32; None without a prefill


def gradient(flip: bool = False) -> Image.Image:
    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    rgb = np.stack([ramp[None, :].repeat(64, 0), ramp[:, None].repeat(64, 1),
                    np.full((64, 64), 128.0)], axis=-1)  # [64, 64, 3]
    return Image.fromarray((255 - rgb if flip else rgb).astype(np.uint8))


def run_engine(checkpoint: Path, requests: list[tuple[Image.Image, str]],
               ec_config=None) -> list[Result]:
    """Start an engine, run `requests` (image, key) one by one, shut the engine down."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        started = time.monotonic()
        llm = LLM(model=str(checkpoint), ec_transfer_config=ec_config, **ENGINE_ARGS)
        print(f"engine start ({ec_config.ec_role if ec_config else 'plain'}): "
              f"{time.monotonic() - started:.1f}s")
    try:
        llm.collective_rpc("install_probe")
        return [run_request(llm, image, key) for image, key in requests]
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_request(llm, image: Image.Image, key: str) -> Result:
    from vllm import SamplingParams

    item = {"type": "image", "image": image, "uuid": key}
    request = {"prompt": PROMPT, "multi_modal_data": {"vision_chunk": [item]},
               "multi_modal_uuids": {"vision_chunk": [key]}}
    output = llm.generate([request], SamplingParams(max_tokens=2, temperature=0.0),
                          use_tqdm=False)[0]
    report = llm.collective_rpc("probe_report")[0]
    ids = output.prompt_token_ids
    rows = None
    if report["prefills"]:
        prefill = torch.tensor(report["prefills"][0])  # [num_tokens, hidden], float32
        rows = prefill[: len(ids)][torch.tensor(ids) == MEDIA_PAD]
    return Result(ids, report["vision_calls"], rows)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_k25_checkpoint(tmp_path_factory.mktemp("k25"))


@pytest.fixture(scope="module")
def store(checkpoint, tmp_path_factory) -> Path:
    """The producer's store after one request for `gradient()` under `KEY`."""
    store = tmp_path_factory.mktemp("ec-store")
    [result] = run_engine(checkpoint, [(gradient(), KEY)], ec_transfer_config("ec_producer", store))
    assert result.vision_calls == 1
    return store


@pytest.fixture(scope="module")
def consumer(checkpoint, store) -> dict[str, Result]:
    """Consumer results: `KEY` again (a hit), then the same image under `SAME_KEY` (a miss: the
    consumer encodes it itself), then another image under `OTHER_KEY` (a miss)."""
    hit, miss, other = run_engine(
        checkpoint, [(gradient(), KEY), (gradient(), SAME_KEY), (gradient(flip=True), OTHER_KEY)],
        ec_transfer_config("ec_consumer", store))
    return {"hit": hit, "miss": miss, "other": other}


def test_producer_stores_the_encoder_output_under_the_uuid(store):
    assert [p.name for p in store.iterdir()] == [KEY]
    stored = get(store, KEY)  # [num_image_tokens, text hidden], the engine's bfloat16
    assert stored.dtype == torch.bfloat16 and stored.shape[0] > 1
    assert torch.isfinite(stored).all() and stored.abs().sum() > 0
    assert list(store_path(store, KEY).parent.iterdir()) == [store_path(store, KEY)]  # no temp file


def test_consumer_hit_skips_the_tower_and_feeds_the_stored_rows(consumer, store):
    hit = consumer["hit"]
    assert hit.vision_calls == 0
    assert torch.equal(hit.image_rows, get(store, KEY).float())


def test_stored_rows_equal_the_consumers_own_encoding_of_the_image(consumer, store):
    miss = consumer["miss"]
    assert miss.vision_calls == 1
    assert torch.equal(miss.image_rows, get(store, KEY).float())
    assert miss.prompt_token_ids == consumer["hit"].prompt_token_ids


def test_consumer_prompt_holds_the_models_placeholder_format(consumer, store, checkpoint):
    from tokenizers import Tokenizer

    ids = consumer["hit"].prompt_token_ids
    begin = ids.index(token_id("<|media_begin|>"))
    opening = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(
        "<|media_begin|>image<|media_content|>", add_special_tokens=False).ids
    num_pads = get(store, KEY).shape[0]
    expected = [*opening, *[MEDIA_PAD] * num_pads, token_id("<|media_end|>")]
    assert ids[begin: begin + len(expected)] == expected
    assert ids.count(MEDIA_PAD) == num_pads


def test_consumer_miss_runs_the_tower_and_creates_nothing(consumer, store):
    other = consumer["other"]
    assert other.vision_calls == 1
    assert not torch.equal(other.image_rows, get(store, KEY).float())
    assert not (store / OTHER_KEY).exists()  # a checked key leaves no empty folder behind
    assert [p.name for p in store.iterdir()] == [KEY]
