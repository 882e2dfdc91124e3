"""`vision.handover: encoder_cache` in a running app: an image is encoded once, in the VisionEncoder.

The app is `configs/local.yaml` on a tiny Kimi-K2.5 checkpoint with random weights
(`synthetic_checkpoints.k25`, written here), which vLLM serves as multimodal. The VisionEncoder
runs its tower in an encoder-only `ec_producer` engine that stores each image's output in a tmp
store; the LanguageModel's `ec_consumer` engine gets the image in K2.5's own prompt format and
loads the stored output. The LanguageModel's workers carry `WorkerProbe`
(`moonserve.pipeline.engine.worker_probe`), which counts the engine's encoder calls and records the
token ids and image rows of each prefill. The engines are this module's own (the session server
may run beside them, in another pytest-xdist worker: tests/conftest.py).

The handover's key property: the rows the engine gets at the image positions are the stored
output, bit-equal to what the engine computes from the pixels itself when the output cannot be
had (the last test), so a handed-over image is exactly an image encoded in the engine. The store's
own rules (atomic put, LRU eviction, key checks): tests/unit/test_ec_store.py.
"""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from moonserve.pipeline.app.launch import join_ray
from moonserve.pipeline.engine.ec_store import get, has, store_path
from moonserve.pipeline.synthetic_checkpoints.k3 import token_id
from moonserve.pipeline.synthetic_checkpoints.k25 import (
    SERVE_ENGINE,
    serve_vision,
    write_k25_checkpoint,
)
from tests.engines.own_app import running_app, serve_calls_in_child
from tests.serving import local_args

HTTP_PORT = 8132
MEDIA_PAD = "<|media_pad|>"


def gradient_png(flip: bool = False, size: tuple[int, int] = (64, 48)) -> bytes:
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
    rgb = np.stack([x, y, np.full_like(x, 128.0)], axis=-1)  # [h, w, 3]
    image = Image.fromarray((255 - rgb if flip else rgb).astype(np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder-cache")
    checkpoint = write_k25_checkpoint(root / "k25")
    store = root / "store"
    data, args = local_args()
    args["router"]["limits"]["max_images"] = 2
    engine = args["language_model"]["engine"]
    engine.update(model=str(checkpoint), **SERVE_ENGINE,
                  worker_extension_cls="moonserve.pipeline.engine.worker_probe.WorkerProbe")
    args["language_model"]["chat"] = {}
    args["vision"] = serve_vision(store)
    args["draft"] = {"mode": "off"}
    with running_app(root, data, HTTP_PORT) as process:
        process.checkpoint, process.store = checkpoint, store
        yield process


@pytest.fixture(scope="module")
def serve_calls(app):
    with serve_calls_in_child(app.ray_address()) as call:
        call("LanguageModel", "collective_rpc", "install_image_probe")
        yield call


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none")


def messages(pngs: list[bytes], text: str = "describe") -> list[dict]:
    content = [{"type": "text", "text": text},
               *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs)]
    return [{"role": "user", "content": content}]


def ask(client, pngs: list[bytes], text: str = "describe"):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=2, temperature=0,
        messages=messages(pngs, text))


def sha256(png: bytes) -> str:
    import hashlib

    return hashlib.sha256(png).hexdigest()


@pytest.fixture(scope="module")
def first(client, serve_calls, app):
    """One request with one image, and what each deployment saw."""
    png = gradient_png()
    before = serve_calls("VisionEncoder", "stats")
    response = ask(client, [png])
    return {"png": png, "response": response, "encoder_before": before,
            "encoder_after": serve_calls("VisionEncoder", "stats"),
            "probe": serve_calls("LanguageModel", "collective_rpc", "image_probe_report")[0]}


def test_image_is_encoded_once_in_the_vision_encoder_and_never_in_the_engine(first, app):
    assert first["encoder_after"]["encoded"] - first["encoder_before"]["encoded"] == 1
    key = sha256(first["png"])
    stored = get(app.store, key)  # [num_image_tokens, text hidden], the engine's bfloat16
    assert stored.dtype == torch.bfloat16 and stored.shape[0] > 1
    assert torch.isfinite(stored).all() and stored.abs().sum() > 0
    assert list(store_path(app.store, key).parent.iterdir()) == [store_path(app.store, key)], \
        "a temp file was left beside the stored output"
    probe = first["probe"]
    assert probe["encoder_calls"] == 0
    assert len(probe["prefills"]) == 1


def test_engine_rows_at_the_image_positions_are_the_stored_output(first, app):
    rows = torch.tensor(first["probe"]["prefills"][0]["image_rows"])
    stored = get(app.store, sha256(first["png"]))
    assert rows.shape == stored.shape and rows.shape[0] > 1
    assert torch.equal(rows, stored.float())


def test_engine_prompt_has_the_models_placeholder_format(first, app):
    ids = first["probe"]["prefills"][0]["input_ids"]
    opening = Tokenizer.from_file(str(app.checkpoint / "tokenizer.json")).encode(
        "<|media_begin|>image<|media_content|>", add_special_tokens=False).ids
    num_rows = len(first["probe"]["prefills"][0]["image_rows"])
    begin = ids.index(token_id("<|media_begin|>"))
    expected = [*opening, *[token_id(MEDIA_PAD)] * num_rows, token_id("<|media_end|>")]
    assert ids[begin: begin + len(expected)] == expected
    assert ids.count(token_id(MEDIA_PAD)) == num_rows
    assert first["response"].usage.prompt_tokens == len(ids)
    # The router counts the image as vLLM's processor expands it (its context checks and lanes
    # use that count; the LM hands vLLM the prompt unexpanded).
    counted = httpx.post(f"{app.base_url}/tokenize", json={"messages": messages([first["png"]])},
                         timeout=60).json()
    assert counted["count"] == len(ids) and counted["tokens"] == ids


def test_a_second_request_for_the_image_is_not_encoded_again(client, serve_calls, first, app):
    before = serve_calls("VisionEncoder", "stats")
    other = gradient_png(flip=True, size=(40, 70))
    ask(client, [first["png"], other], text="compare")
    after = serve_calls("VisionEncoder", "stats")
    probe = serve_calls("LanguageModel", "collective_rpc", "image_probe_report")[0]
    assert after["encoded"] - before["encoded"] == 1  # only the new image
    assert after["hits"] - before["hits"] == 1
    assert probe["encoder_calls"] == 0
    rows = torch.tensor(probe["prefills"][0]["image_rows"])
    stored = torch.cat([get(app.store, sha256(first["png"])), get(app.store, sha256(other))])
    assert torch.equal(rows, stored.float())


def test_text_only_requests_still_reach_the_engine_as_tokens(client, serve_calls):
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "no image here"}])
    assert response.usage.completion_tokens == 3
    assert serve_calls("LanguageModel", "collective_rpc", "image_probe_report")[0]["prefills"] == []


def generate_with_encoder_output(address: str, prompt_ids: list[int], pad_id: int, key: str,
                                 num_rows: int, encoder_store: str, png: bytes) -> int:
    """In the `serve_calls` child: what a Router sends when the VisionEncoder ran on another node
    (the LM's store lacks the entry): where the encoder stored it, `encoder_store` on this node."""
    import ray
    from ray import serve

    from moonserve.pipeline.api.protocol import GenerateRequest, SamplingSpec, StoredEncoding

    join_ray(address)
    stored = StoredEncoding(num_rows, ray.get_runtime_context().get_node_id(), encoder_store)
    request = GenerateRequest(
        "remote-encoder-1", prompt_ids, SamplingSpec(max_tokens=2, temperature=0.0),
        image_placeholder_id=pad_id, image_hashes=(key,), encoder_outputs=(stored,))
    image = Image.open(io.BytesIO(png)).convert("RGB")
    lm = serve.get_deployment_handle("LanguageModel", app_name="moonserve")

    async def generate() -> int:
        from vllm.tokenizers import get_tokenizer

        from moonserve.pipeline.router.output_receiver import OutputReceiver

        info = await lm.model_info.remote()
        receiver = OutputReceiver("127.0.0.1", get_tokenizer(
            info.tokenizer, tokenizer_mode=info.tokenizer_mode,
            trust_remote_code=info.trust_remote_code))
        address = await receiver.start()
        receiver.open(request.request_id)
        try:
            return await lm.generate_to.remote(request, address, image)
        finally:
            receiver.stop()

    return asyncio.run(generate())


def test_an_output_missing_from_the_lms_node_store_is_fetched_from_where_the_encoder_put_it(
        first, serve_calls, app, tmp_path):
    """As if the encoder ran on another node: the entry is only in the encoder's store (another
    folder here), which the request names. The LM fetches it from there (a Ray task on that node)
    and stores it before the engine looks, so the engine still never encodes, and its rows are
    the encoder's."""
    key = sha256(first["png"])
    stored = get(app.store, key)
    prefill = first["probe"]["prefills"][0]
    encoder_store = tmp_path / "encoder-node-store"
    encoder_store.mkdir()
    (app.store / key).rename(encoder_store / key)
    assert not has(app.store, key) and has(encoder_store, key)
    num_tokens = serve_calls.pool.apply(generate_with_encoder_output, (
        serve_calls.address, prefill["input_ids"], token_id(MEDIA_PAD), key, stored.shape[0],
        str(encoder_store), first["png"]))
    assert num_tokens == 2
    assert has(app.store, key) and torch.equal(get(app.store, key), stored)
    probe = serve_calls("LanguageModel", "collective_rpc", "image_probe_report")[0]
    assert probe["encoder_calls"] == 0
    assert torch.equal(torch.tensor(probe["prefills"][0]["image_rows"]), stored.float())


def test_an_output_that_cannot_be_fetched_is_encoded_by_the_engine_as_the_encoder_did(
        first, serve_calls, app, tmp_path):
    """The first image under a key stored nowhere (the encoder's node lost it, or is gone): the
    LM's fetch fails, and its engine runs its own tower on the pixels. Those rows are bit-equal to
    what the VisionEncoder stored for the image, and the engine, a consumer, stores nothing."""
    key = "0" * 64  # the image's uuid in the request: no store holds it
    stored = get(app.store, sha256(first["png"]))
    prefill = first["probe"]["prefills"][0]
    empty_store = tmp_path / "encoder-node-store"
    empty_store.mkdir()
    num_tokens = serve_calls.pool.apply(generate_with_encoder_output, (
        serve_calls.address, prefill["input_ids"], token_id(MEDIA_PAD), key, stored.shape[0],
        str(empty_store), first["png"]))
    assert num_tokens == 2
    probe = serve_calls("LanguageModel", "collective_rpc", "image_probe_report")[0]
    assert probe["encoder_calls"] == 1
    assert torch.equal(torch.tensor(probe["prefills"][0]["image_rows"]), stored.float())
    assert not has(app.store, key) and not any(empty_store.iterdir())
