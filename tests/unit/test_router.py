"""The Router's HTTP behaviour without an engine: errors, lanes, streaming, image fan-in failures,
client disconnects.

The real `Router` class (no Serve) with the embedded model's real tokenizer serves its real FastAPI
app through uvicorn on 127.0.0.1, and httpx talks to it over TCP, so a client that hangs up is a
real disconnect. Only the other deployments are fakes, because no engine may start here:
`FakeLanguageModel` is the real replica's output side (`EngineOutputs`, the real output channel on
127.0.0.1) over a fake engine core that produces scripted text pieces as token ids (so the Router
detokenizes them with vLLM's OutputProcessor, as it does the real engine's), records its requests
and, like the real one, which requests it aborted; the image fakes likewise. Each sits behind
`FakeDeploymentHandle`, which has the parts of a Serve handle the Router uses
(`.method.remote()`, `.cancel()`, `_to_object_ref()`), runs each call as its own task like a
replica, and raises what Ray raises: a replica's exception as `RayTaskError(<its type>)`, a dead
replica's as `ActorDiedError`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import numpy as np
import pytest
from ray.exceptions import ActorDiedError, RayError, RayTaskError

from moonserve.deployments.router import Router
from moonserve.pipeline.api.protocol import GenerateRequest, GenerationDelta, ImageInfo, ModelInfo
from moonserve.pipeline.config import (
    LaneLimits,
    LanesConfig,
    OutputsConfig,
    RouterConfig,
    VisionConfig,
)
from moonserve.pipeline.vision.errors import ImageError
from tests.conftest import MODEL
from tests.fake_engine import engine_request, fake_engine
from tests.serving import listening

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "hi"}]
PIECES = ["Hello", " there", "!"]  # one engine step each


@functools.cache
def embedded_model_path() -> str:
    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return str(prepare_language_model(progress=False))


@functools.cache
def embedded_tokenizer():
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(embedded_model_path())
IMAGE_TOKENS = 4  # per image, from FakeImagePreprocessor
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


def image_chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}]}


class FakeLanguageModel:
    """The LanguageModel methods the Router calls: the real replica's output side
    (`EngineOutputs` and the output channel) over a fake engine core that produces `pieces`
    (one engine step each, as token ids of the embedded model's tokenizer; the last with
    `finish_reason`).

    The call fails with `fail_at_step`'s exception once that many steps are out, and the engine
    waits on `gate` before each step once `hold_after` steps are out. Like the real replica, a
    call that ends before its last step (cancelled, failed) records its request_id in `aborted`.
    """

    def __init__(self, pieces: list[str] = PIECES, finish_reason: str = "stop"):
        from moonserve.pipeline.engine.output_sender import EngineOutputs

        self.info = ModelInfo(name=MODEL, max_model_len=2048, vocab_size=49152,
                              tokenizer=embedded_model_path())
        self.pieces = pieces
        self.engine = fake_engine(self.script, finish_reason)
        self.outputs = EngineOutputs(self.engine)
        self.fail_at_step: tuple[int, BaseException] | None = None
        self.hold_after: int | None = None
        self.gate = asyncio.Event()
        self.health_error: BaseException | None = None
        self.requests: list[GenerateRequest] = []
        self.image_embeds: list[tuple] = []
        self.started = asyncio.Event()
        self.aborted: list[str] = []

    def script(self, core_request) -> list[list[int]]:
        tokenizer = embedded_tokenizer()
        return [tokenizer.encode(piece, add_special_tokens=False) for piece in self.pieces]

    async def generate_to(self, request: GenerateRequest, address, *image_embeds) -> int:
        """The real replica's channel path (`EngineOutputs.run`) over the fake engine core."""
        from moonserve.deployments.language_model import sampling_params

        self.requests.append(request)
        self.image_embeds.append(image_embeds)
        self.started.set()
        core = self.engine.engine_core
        core.hold_after, core.gate = self.hold_after, self.gate
        core.fail_at = self.fail_at_step
        core_request = engine_request(request.request_id, request.prompt_token_ids,
                                      sampling_params(request.sampling))
        connection = await self.outputs.connections.get(address)
        run = asyncio.ensure_future(self.outputs.run(core_request, connection))
        finished = False
        try:
            done, _ = await asyncio.wait({run, core.failure}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                raise core.failure.result()
            finished = True
            return run.result()
        finally:
            if not finished:
                run.cancel()
                self.aborted.append(request.request_id)

    async def model_info(self) -> ModelInfo:
        return self.info

    async def check_health(self) -> None:
        if self.health_error is not None:
            raise self.health_error


class FakeImagePreprocessor:
    """ImagePreprocessor without decoding: every image is a 2x4 patch grid (4 image tokens);
    `failures[url]` is raised for that url."""

    def __init__(self):
        self.failures: dict[str, BaseException] = {}

    async def preprocess(self, url: str) -> ImageInfo:
        if url in self.failures:
            raise self.failures[url]
        return ImageInfo(content_hash=url, grid_thw=(1, 2, 4), num_image_tokens=IMAGE_TOKENS,
                         image_size=(28, 56), pixel_values=None)

    async def ready(self) -> bool:
        return True


class FakeVisionEncoder:
    """VisionEncoder without a model: [num_image_tokens, 8] of the image's index; or `failure`."""

    def __init__(self):
        self.failure: BaseException | None = None
        self.encoded = 0

    async def encode(self, info: ImageInfo) -> np.ndarray:
        if self.failure is not None:
            raise self.failure
        self.encoded += 1
        return np.full((info.num_image_tokens, 8), self.encoded, dtype=np.float32)

    async def stats(self) -> dict[str, int]:
        return {"encoded": self.encoded}


def as_ray_raises(exc: BaseException) -> BaseException:
    """What the caller of a replica sees: Ray's own failures as they are, the replica's exception
    wrapped in a RayTaskError that is also an instance of its type (with `.cause`)."""
    if isinstance(exc, RayError):
        return exc
    return RayTaskError("replica method", "Traceback (fake replica)", exc).as_instanceof_cause()


class FakeObjectRef:
    def __init__(self, task: asyncio.Task):
        self.task = task

    def __await__(self):
        return self.result().__await__()

    async def result(self):
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise as_ray_raises(exc) from None


def resolve_refs(args: tuple) -> list:
    """Ray resolves ObjectRefs passed at the top level before the replica method runs."""
    return [arg.task.result() if isinstance(arg, FakeObjectRef) else arg for arg in args]


class FakeResponse:
    """A DeploymentResponse: the call runs as its own task from `.remote()` on."""

    def __init__(self, coroutine):
        self.ref = FakeObjectRef(asyncio.ensure_future(coroutine))
        self.cancelled = False

    def __await__(self):
        return self.ref.__await__()

    async def _to_object_ref(self) -> FakeObjectRef:
        return self.ref

    def cancel(self) -> None:
        self.cancelled = True
        self.ref.task.cancel()


class FakeDeploymentHandle:
    """The parts of a Serve DeploymentHandle the Router uses, over a plain replica object."""

    def __init__(self, replica):
        self.replica = replica
        self.calls: list[FakeResponse] = []

    def __getattr__(self, name: str):
        method = getattr(self.replica, name)
        return FakeMethod(self, method)


class FakeMethod:
    def __init__(self, handle: FakeDeploymentHandle, method):
        self.handle = handle
        self.method = method

    def remote(self, *args):
        args = resolve_refs(args)
        call = FakeResponse(self.method(*args))
        call.method_name = self.method.__name__
        self.handle.calls.append(call)
        return call


@pytest.fixture(scope="module")
def model_path() -> str:
    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return str(prepare_language_model(progress=False))


@pytest.fixture
def lm() -> FakeLanguageModel:
    return FakeLanguageModel()


@pytest.fixture
def lm_handle(lm) -> FakeDeploymentHandle:
    return FakeDeploymentHandle(lm)


@pytest.fixture
def preprocessor() -> FakeImagePreprocessor:
    return FakeImagePreprocessor()


@pytest.fixture
def encoder() -> FakeVisionEncoder:
    return FakeVisionEncoder()


@pytest.fixture
def encoder_handle(encoder) -> FakeDeploymentHandle:
    return FakeDeploymentHandle(encoder)


@asynccontextmanager
async def serving(router: Router) -> AsyncIterator[httpx.AsyncClient]:
    """The router's app on a free port of 127.0.0.1, and an httpx client for it."""
    async with listening(router.__serve_build_asgi_app__()) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


@pytest.fixture
def router_config() -> RouterConfig:
    """The default config, with the output channel on 127.0.0.1."""
    return RouterConfig(outputs=OutputsConfig(host="127.0.0.1"))


@pytest.fixture
async def text_client(model_path, lm_handle, router_config) -> AsyncIterator[httpx.AsyncClient]:
    """A text-only Router."""
    async with serving(Router(router_config, lm_handle, model_path)) as client:
        yield client


@pytest.fixture
async def image_client(model_path, lm_handle, preprocessor, encoder_handle,
                       router_config) -> AsyncIterator[httpx.AsyncClient]:
    router = Router(router_config, lm_handle, model_path, vision=VisionConfig(),
                    preprocessor=FakeDeploymentHandle(preprocessor), encoder=encoder_handle)
    async with serving(router) as client:
        yield client


def sse_events(body: str) -> list:
    """`data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    payloads = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


async def wait_for(condition, what: str, timeout_s: float = 10) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"waited {timeout_s} s for {what}") from None


@pytest.mark.parametrize("body, param, words", [
    (chat(temperature=3), "temperature", "less than or equal to 2"),
    (chat(frobnicate=1), "frobnicate", "Unrecognized request argument"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "valid string"),
    (chat(max_tokens=10**9), "max_tokens", "maximum context length"),
    ({"messages": USER}, "model", "required"),
])
async def test_bad_requests_are_400_naming_the_field(text_client, lm, body, param, words):
    r = await text_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(param.split("[")[0]) or param in error["message"]
    assert words in error["message"]
    assert lm.requests == []  # refused before the LM


async def test_malformed_json_and_oversized_bodies(text_client):
    r = await text_client.post("/v1/chat/completions", content=b"{not json",
                               headers={"content-type": "application/json"})
    assert_error(r, 400, None, "invalid_json")
    r = await text_client.post("/v1/chat/completions", content=b"x" * ((1 << 20) + 1))
    error = assert_error(r, 413, None, "request_too_large")
    assert str(1 << 20) in error["message"]

    async def chunks():  # chunked: no Content-Length, so the bytes are counted as they arrive
        for _ in range(17):
            yield b"x" * (1 << 16)

    r = await text_client.post("/v1/chat/completions", content=chunks())
    assert_error(r, 413, None, "request_too_large")


async def test_unknown_model_is_404_naming_the_served_one(text_client):
    r = await text_client.post("/v1/chat/completions", json=chat(model="gpt-17"))
    error = assert_error(r, 404, "model", "model_not_found")
    assert "'gpt-17'" in error["message"] and f"'{MODEL}'" in error["message"]
    r = await text_client.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_models_lists_the_lm_model(text_client):
    r = await text_client.get("/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["max_model_len"]) for m in r.json()["data"]] == [(MODEL, 2048)]


async def test_completion_returns_the_lm_text_and_usage(text_client, lm):
    r = await text_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "Hello there!"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4  # the end-of-sequence token counts
    (request,) = lm.requests
    assert request.sampling.max_tokens == 5 and request.sampling.temperature == 0
    assert request.priority == 0  # the interactive lane


async def test_streaming_chat_is_sse_ending_in_done(text_client):
    r = await text_client.post("/v1/chat/completions",
                               json=chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_events(r.text)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hello there!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] == 4 and usage["choices"] == []


async def test_a_first_burst_loads_the_engines_tokenizer_once(model_path, lm_handle,
                                                              router_config, monkeypatch):
    import vllm.tokenizers

    embedded_tokenizer()  # the fake LanguageModel's own, loaded before the count starts
    loads = []
    load = vllm.tokenizers.get_tokenizer

    def counting_load(*args, **kwargs):
        loads.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(vllm.tokenizers, "get_tokenizer", counting_load)
    async with serving(Router(router_config, lm_handle, model_path)) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(
            stream=stream)) for stream in [True, False] * 4))
    assert [r.status_code for r in replies] == [200] * 8
    assert len(loads) == 1


async def test_lm_failure_mid_stream_is_an_error_event_then_done(text_client, lm):
    lm.fail_at_step = (2, RuntimeError("engine core died"))
    r = await text_client.post("/v1/chat/completions",
                               json=chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200  # headers went out with the first delta
    # The error is the last event before [DONE], as vLLM's server ends a stream: no usage after.
    *chunks, error, done = sse_events(r.text)
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hello there"
    assert error["error"]["code"] == "generation_failed"
    assert "RuntimeError" in error["error"]["message"]
    assert lm.aborted == [lm.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_choice_the_engine_ended_with_an_error_is_never_a_200_choice(model_path, stream,
                                                                          router_config):
    """vLLM's FinishReason.ERROR (its scheduler ends a request whose grammar refused a token):
    a 500 for a whole answer, an error event after the tokens before it for a stream."""
    lm = FakeLanguageModel(["{", '"a'], finish_reason="error")
    async with serving(Router(router_config, FakeDeploymentHandle(lm), model_path)) as client:
        r = await client.post("/v1/chat/completions", json=chat(stream=stream))
    if not stream or r.status_code == 500:  # a stream whose deltas arrived merged: no headers yet
        assert_error(r, 500, None, "generation_failed")
        return
    *chunks, error, done = sse_events(r.text)
    assert done == "[DONE]" and error["error"]["code"] == "generation_failed"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks if c["choices"])


async def test_lost_output_channel_mid_stream_is_a_503_event_and_cancels_the_call(
        model_path, lm, lm_handle):
    router = Router(RouterConfig(outputs=OutputsConfig(host="127.0.0.1")), lm_handle, model_path)
    lm.hold_after = 1  # one delta, then the replica "dies": its connection closes
    async with serving(router) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if '"Hello"' in line:
                    lm.outputs.connections.close()
    *_, error, done = [line.removeprefix("data: ") for line in lines if line]
    assert done == "[DONE]"
    assert json.loads(error)["error"]["code"] == "replica_unavailable"
    (call,) = [c for c in lm_handle.calls if c.method_name == "generate_to"]
    assert call.cancelled
    await wait_for(lambda: lm.aborted, "the LM request to be aborted")


@pytest.mark.parametrize("failure, status, code, retry_after", [
    (RuntimeError("engine core died"), 500, "generation_failed", None),
    (ActorDiedError(), 503, "replica_unavailable", "2"),
])
async def test_lm_failure_before_the_first_delta_is_an_http_status(text_client, lm, failure,
                                                                   status, code, retry_after):
    lm.fail_at_step = (0, failure)
    r = await text_client.post("/v1/chat/completions", json=chat(stream=True))
    assert_error(r, status, None, code)
    assert r.headers.get("retry-after") == retry_after


async def test_full_lane_queue_is_429_with_retry_after(model_path, lm, lm_handle):
    lanes = LanesConfig(interactive=LaneLimits(max_in_flight=1, max_queue=0), retry_after_s=7)
    router = Router(RouterConfig(lanes=lanes), lm_handle, model_path)
    lm.hold_after = 0  # the first request holds the interactive lane's only slot
    async with serving(router) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(lm.started.wait(), 10)
        r = await client.post("/v1/chat/completions", json=chat())
        error = assert_error(r, 429, None, "lane_full")
        assert r.headers["retry-after"] == "7" and "interactive lane is full" in error["message"]
        # The long_context lane is separate: a hinted request still gets through once freed.
        lm.gate.set()
        assert (await first).status_code == 200
        r = await client.post("/v1/chat/completions", json=chat(),
                              headers={"x-moonserve-lane": "long_context"})
        assert r.status_code == 200, r.text
    assert [request.priority for request in lm.requests] == [0, 10]
    assert (await router.lane_stats())["interactive"] == {"queued": 0, "in_flight": 0,
                                                         "admitted": 1}


async def test_a_full_app_refuses_before_tokenizing_or_touching_images(
        model_path, lm, lm_handle, preprocessor, encoder_handle, monkeypatch):
    lanes = LanesConfig(enabled=False, fifo=LaneLimits(max_in_flight=1, max_queue=0))
    images = FakeDeploymentHandle(preprocessor)
    router = Router(RouterConfig(lanes=lanes), lm_handle, model_path, vision=VisionConfig(),
                    preprocessor=images, encoder=encoder_handle)
    tokenized = []
    render = router.prompts.chat_prompt_ids
    monkeypatch.setattr(router.prompts, "chat_prompt_ids",
                        lambda *a, **k: tokenized.append(1) or render(*a, **k))
    lm.hold_after = 0  # the first request holds the only slot
    async with serving(router) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(lm.started.wait(), 10)
        assert len(tokenized) == 1 and not images.calls
        for body in (chat(), image_chat(PNG_URL)):
            assert_error(await client.post("/v1/chat/completions", json=body), 429, None,
                         "lane_full")
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert_error(r, 429, None, "lane_full")
        assert len(tokenized) == 1 and not images.calls  # no work for the refused
        lm.gate.set()
        assert (await first).status_code == 200


async def test_unknown_lane_hint_is_400_naming_the_header(text_client):
    r = await text_client.post("/v1/chat/completions", json=chat(),
                               headers={"x-moonserve-lane": "express"})
    error = assert_error(r, 400, "x-moonserve-lane", None)
    assert "'express'" in error["message"]


async def test_client_disconnect_cancels_the_lm_stream(model_path, lm, lm_handle, router_config):
    router = Router(router_config, lm_handle, model_path)
    lm.hold_after = 1  # one delta, then the stream waits for tokens that never come
    async with serving(router) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"Hello"' in line:
                    break  # the client hangs up mid-stream
        await wait_for(lambda: lm.aborted, "the LM generate to be cancelled")
    # The generate stream, or generate_to's call with the channel.
    (call,) = [c for c in lm_handle.calls if c.method_name.startswith("generate")]
    assert call.cancelled
    assert lm.aborted == [lm.requests[0].request_id]
    assert (await router.lane_stats())["interactive"]["in_flight"] == 0


async def test_images_reach_the_lm_as_encoder_outputs(image_client, lm, encoder_handle):
    r = await image_client.post("/v1/chat/completions", json=image_chat(PNG_URL, PNG_URL + "A"))
    assert r.status_code == 200, r.text
    (request,) = lm.requests
    placeholder = request.image_placeholder_id
    assert placeholder is not None
    assert request.prompt_token_ids.count(placeholder) == 2 * IMAGE_TOKENS
    (embeds,) = lm.image_embeds
    assert [e.shape for e in embeds] == [(IMAGE_TOKENS, 8)] * 2
    assert all(call.cancelled for call in encoder_handle.calls)  # released after the request


@pytest.mark.parametrize("failure, status, param, code, words", [
    (ImageError("truncated image file"), 400, "messages[0].content[2]", "invalid_image",
     "messages[0].content[2]: truncated image file"),
    (RuntimeError("out of memory"), 500, None, "image_failed",
     "messages[0].content[2]: the image preprocessor failed (RuntimeError)"),
    (ActorDiedError(), 503, None, "replica_unavailable", "image preprocessor is unavailable"),
])
async def test_preprocessor_failures_map_to_4xx_and_5xx(image_client, lm, preprocessor, failure,
                                                        status, param, code, words):
    preprocessor.failures["data:image/png;base64,bad"] = failure
    r = await image_client.post("/v1/chat/completions",
                                json=image_chat(PNG_URL, "data:image/png;base64,bad"))
    error = assert_error(r, status, param, code)
    assert words in error["message"]
    assert lm.requests == []


@pytest.mark.parametrize("failure, status, code, words", [
    (RuntimeError("CUDA error"), 500, "image_failed", "image 0: the vision encoder failed"),
    (ActorDiedError(), 503, "replica_unavailable", "vision encoder is unavailable"),
])
async def test_encoder_failures_map_to_5xx(image_client, lm, encoder, failure, status, code, words):
    encoder.failure = failure
    r = await image_client.post("/v1/chat/completions", json=image_chat(PNG_URL))
    error = assert_error(r, status, None, code)
    assert words in error["message"]
    assert lm.requests == []


async def test_image_parts_on_a_text_only_router_are_400(text_client):
    r = await text_client.post("/v1/chat/completions", json=image_chat(PNG_URL))
    error = assert_error(r, 400, "messages[0].content[1]", "images_not_supported")
    assert "no vision deployments" in error["message"]


async def test_health_reports_an_unhealthy_lm_as_503(text_client, lm):
    assert (await text_client.get("/health")).json() == {"status": "ok"}
    lm.health_error = RuntimeError("engine dead")
    r = await text_client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json() == {"status": "unavailable", "reason": "RayTaskError(RuntimeError)"}


@pytest.mark.parametrize("gather, logged", [(asyncio.gather, True), ("gather_calls", False)])
async def test_calls_cancelled_after_their_request_left_log_nothing(caplog, gather, logged):
    """A Serve call raises CancelledError itself when its request is cancelled; by then nobody
    awaits the gather. asyncio.gather then logs a traceback per request; gather_calls does not."""
    import gc

    from moonserve.pipeline.router.failures import gather_calls

    gather = gather_calls if gather == "gather_calls" else gather

    async def call_of_a_cancelled_request():
        raise asyncio.CancelledError

    gathered = gather(call_of_a_cancelled_request())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert gathered.done()
    del gathered
    with caplog.at_level("ERROR", logger="asyncio"):
        gc.collect()
    assert ("exception was never retrieved" in caplog.text) is logged


def test_parameters_vllm_refuses_are_a_400_naming_them():
    from vllm.exceptions import VLLMValidationError

    from moonserve.pipeline.router.failures import lm_failure

    error = lm_failure(VLLMValidationError("too many", parameter="n", value=3), "r1")
    assert (error.status, error.param) == (400, "n") and "too many" in error.message
    assert lm_failure(RuntimeError("engine bug"), "r1").status == 500


async def test_an_unhandled_error_is_an_openai_500_naming_the_request_logged_once(
        text_client, lm, caplog):
    """A bug in a handler (here the LM's model_info raises what no mapping expects) answers an
    OpenAI-shaped 500 whose message names the request id of the `x-request-id` header, and the
    Router logs it once, with its traceback."""

    async def broken_model_info():
        raise KeyError("a bug")

    lm.model_info = broken_model_info
    with caplog.at_level("ERROR", logger="moonserve.router"):
        r = await text_client.post("/v1/chat/completions", json=chat(),
                                   headers={"x-request-id": "req-42"})
    error = assert_error(r, 500, None, "internal_error")
    assert error["type"] == "internal_error" and "req-42" in error["message"]
    logged = [rec for rec in caplog.records if rec.name == "moonserve.router"]
    assert len(logged) == 1 and logged[0].exc_info is not None and "req-42" in logged[0].message
    r = await text_client.get("/v1/models")  # without the header: the Router makes an id
    assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]


def test_engine_logprobs_are_floored_as_vllm_floors_them():
    """A token a grammar masks has logprob -inf in vLLM's map (and NaN must not pass either):
    every logprob the Router hands on is a finite number, floored at vLLM's -9999.0."""
    from vllm.logprobs import Logprob

    from moonserve.pipeline.router.output_receiver import token_logprobs
    from moonserve.pipeline.api.protocol import MIN_LOGPROB

    candidates = {5: Logprob(-0.25, rank=1, decoded_token="a"),
                  7: Logprob(float("-inf"), rank=2, decoded_token="b"),
                  9: Logprob(float("nan"), rank=3, decoded_token="c")}
    (entry,) = token_logprobs([7], [candidates], num_top=3)
    assert entry.logprob == MIN_LOGPROB == -9999.0
    assert entry.top == (("a", -0.25), ("b", MIN_LOGPROB), ("c", MIN_LOGPROB))
    assert json.loads(json.dumps(msgspec.to_builtins(entry), allow_nan=False))
