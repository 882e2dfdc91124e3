"""Router deployment: the HTTP ingress with the OpenAI API.

It validates and tokenizes each request, checks it against the model's context, forwards it to the
LanguageModel deployment and streams the deltas back as SSE. Every rejection is an OpenAI-style
error (`pipeline.errors.APIError`).

Example (without Serve, with any object that has the LanguageModel's methods):
    >>> router = Router(RouterConfig(), lm_handle, model_path="/path/to/ckpt")
    >>> app = router.__serve_build_asgi_app__()     # a FastAPI app
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.auth import ApiKeys
from pipeline.config import RouterConfig
from pipeline.errors import APIError, from_validation_error
from pipeline.limits import check_chat_limits, check_completion_limits
from pipeline.prompt import PromptBuilder, resolve_max_tokens
from pipeline.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Completion,
    GenerateRequest,
    ModelInfo,
    sampling_spec,
)
from pipeline.streaming import ResponseFormat, StreamEncoder, sse

logger = logging.getLogger("moonserve.router")

# Prompts longer than this are tokenized off the event loop, so a long-context request does not
# stall the streams of everyone else on this replica.
INLINE_TOKENIZE_CHARS = 16_384
HEALTH_TIMEOUT_S = 5.0


class Router:
    """`api_keys` is None when auth is off (the builder resolves keys from config and env)."""

    def __init__(self, config: RouterConfig, language_model, model_path: str,
                 api_keys: ApiKeys | None = None):
        self.limits = config.limits
        self.lm = language_model
        self.api_keys = api_keys
        self.prompts = PromptBuilder.from_pretrained(model_path)
        self._info: ModelInfo | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="moonserve", version="0.1.0")
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_exception_handler(APIError, api_error_response)
        app.add_exception_handler(StarletteHTTPException, http_error_response)
        return app

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.lm.model_info.remote()
        return self._info

    def authenticate(self, request: Request) -> None:
        if self.api_keys is not None:
            self.api_keys.check(request.headers.get("authorization"))

    async def parse(self, request: Request, model):
        """Auth, then the body within its byte limit, then validation: cheapest refusals first."""
        self.authenticate(request)
        return parse_body(model, await read_body(request, self.limits.max_request_bytes))

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse(request, ChatCompletionRequest)
        check_chat_limits(body, self.limits)
        info = await self.check_model(body.model)
        prompt_ids = await self.tokenize(self.prompts.chat_prompt_ids, body,
                                         sum(len(m.text()) for m in body.messages))
        return await self.respond(body, prompt_ids, info, "messages", f"chatcmpl-{uuid.uuid4().hex}",
                                  chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self.parse(request, CompletionRequest)
        check_completion_limits(body, self.limits)
        info = await self.check_model(body.model)
        prompt_ids = await self.tokenize(lambda b: self.prompts.completion_prompt_ids(b, info), body,
                                         len(body.prompt))
        return await self.respond(body, prompt_ids, info, "prompt", f"cmpl-{uuid.uuid4().hex}",
                                  chat=False)

    async def models(self, request: Request) -> dict:
        self.authenticate(request)
        info = await self.model_info()
        card = {"id": info.name, "object": "model", "created": 0, "owned_by": "moonserve",
                "max_model_len": info.max_model_len}
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.lm.check_health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # any failure means "not ready"; the reason goes to the body
            return JSONResponse({"status": "unavailable", "reason": type(exc).__name__}, 503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    async def check_model(self, name: str) -> ModelInfo:
        info = await self.model_info()
        if name != info.name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{info.name}'", param="model", code="model_not_found")
        return info

    async def tokenize(self, fn, body, num_chars: int) -> list[int]:
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return fn(body)
        return await asyncio.to_thread(fn, body)

    async def respond(self, body, prompt_ids, info, prompt_param, request_id, chat) -> Response:
        max_tokens = resolve_max_tokens(len(prompt_ids), body.requested_max_tokens(), info,
                                        prompt_param, self.limits.default_max_tokens)
        request = GenerateRequest(request_id, prompt_ids, sampling_spec(body, max_tokens))
        fmt = ResponseFormat(request_id, info.name, chat=chat)
        if not body.stream:
            return JSONResponse(fmt.full(await self.complete(request)))
        deltas = self.deltas(request)
        # Wait for the first delta before sending headers, so a failure before any token (LM
        # replica gone, engine error) is an HTTP status the client can act on, not a 200 stream.
        first = await anext(deltas, None)
        encoder = StreamEncoder(fmt, body.include_usage())
        return StreamingResponse(self.stream(first, deltas, encoder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def complete(self, request: GenerateRequest) -> Completion:
        completion = Completion()
        async for delta in self.deltas(request):
            completion.add(delta)
        return completion

    async def stream(self, first, deltas, encoder: StreamEncoder):
        try:
            yield encoder.opening()
            if first is not None and (chunk := encoder.encode(first)):
                yield chunk
            async for delta in deltas:
                if chunk := encoder.encode(delta):
                    yield chunk
        except APIError as exc:
            # Headers are gone; OpenAI clients read an `error` event in the stream.
            yield sse(exc.body())
        finally:
            await deltas.aclose()
        yield encoder.closing()

    async def deltas(self, request: GenerateRequest):
        """Stream from the LM; cancelling this (client disconnect) cancels the LM request."""
        stream = self.lm.options(stream=True).generate.remote(request)
        exhausted = False
        try:
            async for delta in stream:
                yield delta
            exhausted = True
        except Exception as exc:
            raise lm_failure(exc, request.request_id) from exc
        finally:
            if not exhausted:
                # Stopping iteration does not cancel a Serve stream; this reaches the replica as
                # CancelledError, and LanguageModel.generate aborts the engine request.
                stream.cancel()


def lm_failure(exc: Exception, request_id: str) -> APIError:
    """Map a failure of the LM call to an API error (503 when the replica or engine is gone)."""
    if isinstance(exc, APIError):
        return exc
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    logger.warning("request %s failed in the language model: %r", request_id, exc)
    if isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError)):
        return APIError(503, "the language model replica is unavailable; retry the request",
                        type="service_unavailable", code="replica_unavailable",
                        headers={"Retry-After": "2"})
    return APIError(500, f"generation failed ({type(exc).__name__}); request {request_id}",
                    type="internal_error", code="generation_failed")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes",
                    code="request_too_large")


def parse_body(model, raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def api_error_response(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(error.body(), exc.status_code)
