"""Router deployment: the HTTP ingress with the OpenAI API (chat and text completions, the
Responses API) and Anthropic's Messages API; the last two run as chat requests
(`moonserve.pipeline.api.responses`, `moonserve.pipeline.api.messages`).

It validates and tokenizes each request, checks it against the model's context, starts its images
(`moonserve.pipeline.router.fan_in`), admits it through its lane (`moonserve.pipeline.api.lanes`),
forwards it to the LanguageModel deployment with the lane's priority and streams the deltas back
as SSE. Every rejection is an OpenAI-style error (`moonserve.pipeline.api.errors.APIError`; failures
of the other deployments are mapped in `moonserve.pipeline.router.failures`); TTFT, inter-token
latency and lane counts go to Ray metrics.

Example (without Serve, with any object that has the LanguageModel's methods):
    >>> router = Router(RouterConfig(), lm_handle, model_path="/path/to/ckpt")
    >>> app = router.__serve_build_asgi_app__()     # a FastAPI app
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moonserve.pipeline.api.application_lanes import SharedLanes
from moonserve.pipeline.api.auth import ApiKeys, bearer_key, client_id, digest
from moonserve.pipeline.api.background import in_background
from moonserve.pipeline.api.body import parse_body, read_body
from moonserve.pipeline.api.errors import APIError, InternalErrors, bad_request
from moonserve.pipeline.api.lanes import Lanes
from moonserve.pipeline.api.limits import (
    check_chat_limits,
    check_completion_limits,
    check_message_limits,
    check_prompt_chars,
)
from moonserve.pipeline.api.messages import (
    CountTokensRequest,
    MessagesRequest,
    MessagesTurn,
    anthropic_error,
)
from moonserve.pipeline.api.prompt import PromptBuilder, check_token_ids, resolve_max_tokens
from moonserve.pipeline.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ModelInfo,
    TokenizeRequest,
    sampling_spec,
)
from moonserve.pipeline.api.response_store import open_store
from moonserve.pipeline.api.responses import ResponsesRequest, ResponsesTurn, renamed
from moonserve.pipeline.api.streaming import ResponseFormat, StreamEncoder
from moonserve.pipeline.api.token_buckets import rate_limited
from moonserve.pipeline.config import ChatConfig, RouterConfig, VisionConfig
from moonserve.pipeline.models.chat_templates import chat_template_text
from moonserve.pipeline.metrics import RequestTrace, RouterMetrics
from moonserve.pipeline.router.chat_parsing import ChatParsing, ChatPlan, rendering_for
from moonserve.pipeline.router.failures import gather_calls, lm_failure
from moonserve.pipeline.router.fan_in import EncodingImages, ImageFanIn
from moonserve.pipeline.router.output_receiver import ChannelLost, OutputReceiver, RequestOutputs

logger = logging.getLogger("moonserve.router")

# Prompts longer than this are tokenized off the event loop, so a long-context request does not
# stall the streams of everyone else on this replica.
INLINE_TOKENIZE_CHARS = 16_384
HEALTH_TIMEOUT_S = 5.0
# How long a request's deltas may trail its finished LanguageModel call on the output channel.
CHANNEL_GRACE_S = 10.0


class Router:
    """`api_keys` is None when auth is off (the builder resolves keys from config and env);
    `vision` is None when the app has no ImagePreprocessor and VisionEncoder (their handles);
    `rate_limiter` is None when `router.rate_limits` sets no limit (else the RateLimiter's handle);
    `admission` is the LaneAdmission's handle when the lanes are the application's and the Router
    has replicas, else None (this replica's own lanes)."""

    def __init__(self, config: RouterConfig, language_model, model_path: str,
                 api_keys: ApiKeys | None = None, vision: VisionConfig | None = None,
                 preprocessor=None, encoder=None, trust_remote_code: bool = False,
                 chat: ChatConfig | None = None, rate_limiter=None, admission=None):
        self.limits = config.limits
        self.lm = language_model
        self.api_keys = api_keys
        self.rate_limiter = rate_limiter
        self.rate_limits = config.rate_limits
        chat = chat or ChatConfig()
        # Kimi checkpoints ship their own tokenizer code (the engine's trust_remote_code).
        self.prompts = PromptBuilder.from_pretrained(
            model_path, trust_remote_code,
            chat_template_text(chat.template) if chat.template else None)
        self.prompts.rendering = rendering_for(model_path)
        self.parsing = ChatParsing(self.prompts.tokenizer, chat, self.prompts.rendering)
        self.images = None if vision is None else image_fan_in(
            vision, preprocessor, encoder, model_path, self.prompts.tokenizer)
        self.image_placeholder_id = None if self.images is None else \
            self.prompts.token_id(self.images.placeholder)
        self.metrics = RouterMetrics()
        self.lanes = Lanes(config.lanes, observer=self.metrics) if admission is None else \
            SharedLanes(config.lanes, admission, observer=self.metrics)
        self.hint_header = config.lanes.hint_header
        self.template_tokens = template_tokens(self.prompts)
        self.output_host = config.outputs.host
        self.responses = config.responses
        self.store = open_store(config.responses.database, config.responses.retention_s)
        self.receiver: OutputReceiver | None = None  # made with the engine's tokenizer, once
        self.making_receiver: asyncio.Future | None = None
        self._info: ModelInfo | None = None
        lanes = "off" if not config.lanes.enabled else \
            "application" if admission is not None else "replica"
        logging.getLogger("ray.serve").info(
            "moonserve Router: lanes=%s, ingress=%s, tools=%s strict_level=%s, reasoning=%s, "
            "images=%s, auth=%s", lanes, config.ingress, chat.tools.parser,
            chat.tools.strict_level, chat.reasoning.parser,
            vision.handover if vision is not None else "none",
            "on" if api_keys is not None else "off")

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="moonserve", version="0.1.0")
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/messages", self.create_message, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_message_tokens,
                          methods=["POST"])
        app.add_api_route("/v1/responses", self.create_response, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.get_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response,
                          methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.response_input_items,
                          methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize_endpoint, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize_endpoint, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_exception_handler(APIError, api_error_response)
        app.add_exception_handler(StarletteHTTPException, http_error_response)
        app.add_middleware(InternalErrors)
        return app

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.lm.model_info.remote()
        return self._info

    def authenticate(self, request: Request) -> None:
        if self.api_keys is not None:
            self.api_keys.check(authorization(request))

    async def parse(self, request: Request, model):
        """Auth, then the client's rate limits, then the body within its byte limit, then
        validation: cheapest refusals first."""
        self.authenticate(request)
        await self.check_rate(request)
        raw = await read_body(request, self.limits.max_request_bytes)
        request.state.body_bytes = len(raw)
        return parse_body(model, raw)

    def refuse_early(self, request: Request, bounded: bool) -> None:
        """429/503 before any tokenization or image work when every lane the request may land in
        is full. `bounded`: its prompt has at most its body's bytes in tokens, plus the chat
        template's own (no images or tools, which the template may expand)."""
        limit = request.state.body_bytes + self.template_tokens \
            if bounded and self.template_tokens is not None else None
        self.lanes.refuse_early(request.headers.get(self.hint_header), limit)

    def client(self, request: Request) -> str:
        return client_id(authorization(request),
                         request.client.host if request.client else None,
                         keyed=self.api_keys is not None)

    async def check_rate(self, request: Request) -> None:
        """429 + Retry-After when the client is over one of `router.rate_limits`."""
        if self.rate_limiter is None:
            return
        try:
            refusal = await self.rate_limiter.acquire.remote(self.client(request))
        except Exception as exc:  # noqa: BLE001 - a limiter restart must not stop the service
            logger.warning("rate limiter unavailable (%s: %s); request let in",
                           type(exc).__name__, exc)
            return
        if refusal is not None:
            raise rate_limited(self.rate_limits, *refusal)

    def rate_charge(self, request: Request, num_prompt_tokens: int):
        """What a request's trace calls when it ends: its tokens go on the client's bill."""
        if self.rate_limiter is None:
            return None
        client = self.client(request)
        return lambda num_tokens: in_background(self.rate_limiter.charge.remote(
            client, num_prompt_tokens + num_tokens), "rate limit charge")

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.parse(request, ChatCompletionRequest)
        return await self.run_chat(request, body, arrival, f"chatcmpl-{uuid.uuid4().hex}")

    async def run_chat(self, request: Request, body: ChatCompletionRequest, arrival: float,
                       request_id: str, turn: ResponsesTurn | MessagesTurn | None = None,
                       keep=None, bounded: bool = True) -> Response:
        """A chat request's whole path after parsing; `turn` when it answers `POST /v1/responses`
        or `POST /v1/messages` (`keep` stores a Response). `bounded`: the body holds the whole
        conversation (not so for a Responses turn that continues stored ones)."""
        check_chat_limits(body, self.limits)
        info = await self.check_model(body.model)
        self.refuse_early(request, bounded=bounded and not body.image_parts() and not body.tools)
        plan = self.parsing.plan(body)
        images = await self.start_images(body)
        placeholder = "" if self.images is None else self.images.placeholder
        text = None if self.images is None else self.images.text
        counts = [] if self.images is None else self.images.counts(images.infos)
        try:
            prompt_ids = await self.tokenize(
                lambda b: self.prompts.chat_prompt_ids(
                    b.messages, placeholder, counts, template_kwargs=b.template_kwargs(),
                    template_param="chat_template_kwargs" if b.chat_template_kwargs else "messages",
                    image_text=text),
                body,
                sum(len(m.text()) for m in body.messages))
        except BaseException:
            images.release()
            raise
        job = Job(request_id, body, prompt_ids, info, "messages", chat=True, images=images,
                  plan=plan, turn=turn, keep=keep)
        try:
            return await self.admit_and_respond(request, job, arrival)
        finally:
            images.release()

    async def start_images(self, body: ChatCompletionRequest) -> EncodingImages:
        """Preprocess every image part concurrently, then start their encodings (not awaited:
        they run while the prompt is tokenized and the request waits for its lane)."""
        parts = body.image_parts()
        if not parts:
            return EncodingImages.none()
        self.check_vision(parts)
        return await self.images.start(parts)

    def check_vision(self, parts: list[tuple[int, int, str]]) -> None:
        if self.images is None:
            i, j, _ = parts[0]
            raise bad_request(f"messages[{i}].content[{j}]: this server has no vision "
                              "deployments; send text only", f"messages[{i}].content[{j}]",
                              "images_not_supported")

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.parse(request, CompletionRequest)
        check_completion_limits(body, self.limits)
        info = await self.check_model(body.model)
        self.refuse_early(request, bounded=True)
        prompt_ids = await self.tokenize(lambda b: self.prompts.completion_prompt_ids(b, info), body,
                                         len(body.prompt))
        job = Job(f"cmpl-{uuid.uuid4().hex}", body, prompt_ids, info, "prompt", chat=False)
        return await self.admit_and_respond(request, job, arrival)

    async def create_response(self, request: Request) -> Response:
        """OpenAI's `POST /v1/responses`, run as a chat request (`ResponsesTurn`)."""
        arrival = time.monotonic()
        body = await self.parse(request, ResponsesRequest)
        if body.store and request.state.body_bytes > self.responses.max_stored_bytes:
            limit = self.responses.max_stored_bytes
            raise bad_request(f"store: a request of {request.state.body_bytes} bytes exceeds the "
                              f"{limit} bytes a stored response may hold; send store: false",
                              "store", "response_too_large_to_store")
        owner = self.owner(request)
        history, session = ([], None) if body.previous_response_id is None else \
            await asyncio.to_thread(self.store.history, owner, body.previous_response_id)
        info = await self.check_model(body.model)
        turn = ResponsesTurn(body, history, info.name, session)
        chat = turn.chat_request()

        async def keep(response: dict) -> None:
            await asyncio.to_thread(self.store.put, owner, response, turn.items,
                                    turn.turn_messages(response))

        try:
            return await self.run_chat(request, chat, arrival, turn.response_id, turn,
                                       keep if body.store else None, bounded=not history)
        except APIError as exc:
            raise renamed(exc, turn.origins_of_chat) from None

    async def create_message(self, request: Request) -> Response:
        """Anthropic's `POST /v1/messages`, run as a chat request (`MessagesTurn`); errors in
        Anthropic's shape."""
        try:
            arrival = time.monotonic()
            body = await self.parse(request, MessagesRequest)
            turn = MessagesTurn(body, (await self.check_model(body.model)).name)
            chat = turn.chat_request()
            try:
                return await self.run_chat(request, chat, arrival, turn.message_id, turn)
            except APIError as exc:
                raise turn.renamed(exc) from None
        except APIError as exc:
            return JSONResponse(anthropic_error(exc), exc.status, headers=exc.headers)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens, images and tools
        included, as the request would be charged."""
        try:
            body = await self.parse(request, CountTokensRequest)
            turn = MessagesTurn(body, (await self.check_model(body.model)).name)
            chat = turn.chat_request()
            try:
                check_chat_limits(chat, self.limits)
                return JSONResponse({"input_tokens": len(await self.chat_prompt_ids(chat))})
            except APIError as exc:
                raise turn.renamed(exc) from None
        except APIError as exc:
            return JSONResponse(anthropic_error(exc), exc.status, headers=exc.headers)

    async def chat_prompt_ids(self, body: ChatCompletionRequest | TokenizeRequest,
                              add_generation_prompt: bool = True) -> list[int]:
        """The prompt a chat request (or `/tokenize`'s messages) would get, its images
        preprocessed to count their tokens (not encoded)."""
        parts = body.image_parts()
        image_tokens = []
        if parts:
            self.check_vision(parts)
            image_tokens = self.images.counts(await self.images.layout(parts))
        return await self.tokenize(lambda b: self.prompts.chat_prompt_ids(
            b.messages, self.images.placeholder if parts else "", image_tokens,
            add_generation_prompt=add_generation_prompt, template_kwargs=b.template_kwargs(),
            image_text=self.images.text if parts else None), body,
            sum(len(m.text()) for m in body.messages))

    async def get_response(self, request: Request, response_id: str) -> dict:
        self.authenticate(request)
        return await asyncio.to_thread(self.store.get, self.owner(request), response_id)

    async def delete_response(self, request: Request, response_id: str) -> dict:
        self.authenticate(request)
        await asyncio.to_thread(self.store.delete, self.owner(request), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def response_input_items(self, request: Request, response_id: str) -> dict:
        """The stored turn's input items, paged as OpenAI pages them (`limit`, `order`,
        `after`)."""
        self.authenticate(request)
        items = await asyncio.to_thread(self.store.input_items, self.owner(request), response_id)
        return page(items, request.query_params)

    def owner(self, request: Request) -> str:
        """Whose stored responses a request sees: its API key's digest ("" when auth is off)."""
        if self.api_keys is None:
            return ""
        return digest(bearer_key(authorization(request)) or "").hex()

    async def tokenize_endpoint(self, request: Request) -> dict:
        """vLLM's `POST /tokenize`: the prompt ids a completion or chat request would get (images
        preprocessed to count their tokens, not encoded)."""
        body = await self.parse(request, TokenizeRequest)
        info = await (self.model_info() if body.model is None else self.check_model(body.model))
        if body.prompt is not None:
            check_prompt_chars(body.prompt, self.limits)
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.tokenize(
                lambda b: self.prompts.tokenizer.encode(b.prompt, add_special_tokens=add_special),
                body, len(body.prompt))
        else:
            check_message_limits(body.messages, len(body.image_parts()), self.limits)
            ids = await self.chat_prompt_ids(body, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = self.prompts.tokenizer.build_inputs_with_special_tokens(ids)
        strs = self.prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize_endpoint(self, request: Request) -> dict:
        """vLLM's `POST /detokenize`."""
        body = await self.parse(request, DetokenizeRequest)
        info = await (self.model_info() if body.model is None else self.check_model(body.model))
        check_token_ids(body.tokens, info, "tokens")
        return {"prompt": self.prompts.tokenizer.decode(body.tokens)}

    async def models(self, request: Request) -> dict:
        self.authenticate(request)
        info = await self.model_info()
        card = {"id": info.name, "object": "model", "created": 0, "owned_by": "moonserve",
                "max_model_len": info.max_model_len}
        return {"object": "list", "data": [card]}

    async def lane_stats(self) -> dict[str, dict[str, int]]:
        """Per lane: requests queued, in flight, and admitted since start (the application's with
        `router.lanes.scope: application` and several Router replicas, else this replica's)."""
        return await self.lanes.stats()

    async def health(self) -> Response:
        checks = [self.lm.check_health.remote()]
        if self.images is not None:
            checks += [self.images.preprocessor.ready.remote(), self.images.encoder.stats.remote()]
        try:
            await asyncio.wait_for(gather_calls(*checks), HEALTH_TIMEOUT_S)
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

    async def admit_and_respond(self, request: Request, job: Job, arrival: float) -> Response:
        """Everything is checked before the lane queue, so a queued request is one that will run.
        The slot is held until the last token is sent (a stream's response releases it)."""
        max_tokens = resolve_max_tokens(len(job.prompt_ids), job.body.requested_max_tokens(),
                                        job.info, job.prompt_param, self.limits.default_max_tokens)
        check_token_ids(job.body.stop_token_ids or [], job.info, "stop_token_ids")
        lane = self.lanes.classify(len(job.prompt_ids), request.headers.get(self.hint_header))
        plan = job.plan
        sampling = sampling_spec(job.body, max_tokens,
                                 plan.structured_outputs if plan else None,
                                 plan.skip_special_tokens if plan else None)
        trace = RequestTrace(self.metrics, lane, arrival,
                             on_finish=self.rate_charge(request, len(job.prompt_ids)))
        slot = await self.lanes.admit(lane)
        try:
            self.metrics.prompt(lane, len(job.prompt_ids))
            generate = GenerateRequest(
                job.request_id, job.prompt_ids, sampling, priority=slot.priority,
                image_placeholder_id=self.image_placeholder_id if job.images.infos else None,
                reasoning_ended=plan.reasoning_ended(job.prompt_ids) if plan else None,
                image_hashes=tuple(info.content_hash for info in job.images.infos),
                cache_key=job.body.prompt_cache_key or job.body.user)
            if job.images.infos:
                job.image_embeds, outputs = await job.images.engine_inputs(
                    self.images.engine_cache)
                generate = dataclasses.replace(generate, encoder_outputs=outputs)
            if job.body.stream:
                return await self.respond_stream(job, generate, slot, trace)
            completion = await self.complete(generate, trace, job.image_embeds)
            # Parsed here: an answer without the call tool_choice requires is an error.
            body = job.full(completion)
            if job.keep is not None:
                await job.keep(body)
        except BaseException:
            slot.release()
            trace.finish(ok=False)
            raise
        slot.release()
        trace.finish(ok=True)
        return JSONResponse(body)

    async def respond_stream(self, job: Job, generate: GenerateRequest, slot,
                             trace: RequestTrace) -> Response:
        deltas = self.deltas(generate, trace, job.image_embeds)
        # Wait for the first delta before sending headers, so a failure before any token (LM
        # replica gone, engine error) is an HTTP status the client can act on, not a 200 stream.
        first = await anext(deltas, None)
        return SlotStreamingResponse(slot, trace,
                                     self.stream(first, deltas, job.stream_encoder(), job.keep),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

    async def complete(self, request: GenerateRequest, trace: RequestTrace,
                       image_embeds: list) -> Completion:
        completion = Completion()
        async for delta in self.deltas(request, trace, image_embeds):
            completion.add(delta)
        return completion

    async def stream(self, first, deltas, encoder, keep=None):
        """`keep`: stores the Response a Responses stream ends with."""
        failed = False
        try:
            yield encoder.opening()
            if first is not None and (chunk := encoder.encode(first)):
                yield chunk
            async for delta in deltas:
                if chunk := encoder.encode(delta):
                    yield chunk
        except APIError as exc:
            # Headers are gone; OpenAI clients read an `error` event in the stream.
            failed = True
            yield encoder.error(exc)
        except Exception as exc:  # a bug past the headers still ends the stream as a client reads it
            failed = True
            logger.exception("request %s: the stream failed", encoder.request_id)
            yield encoder.error(APIError(500, f"the stream failed ({type(exc).__name__}); "
                                         f"request {encoder.request_id}",
                                         type="internal_error", code="stream_failed"))
        finally:
            await deltas.aclose()
        # An error event is the stream's last before [DONE] (as vLLM's server ends it): no usage
        # chunk after it, which an OpenAI client, having raised at the error, never reads.
        closing = encoder.closing(with_usage=not failed)
        if keep is not None and not failed:
            try:
                await keep(encoder.response)  # before the last event: it says the turn is kept
            except APIError as exc:
                yield encoder.error(exc)
        yield closing

    async def deltas(self, request: GenerateRequest, trace: RequestTrace, image_embeds: list):
        """The request's deltas: vLLM's engine core outputs arrive on this replica's output
        channel, merged per step, and are processed here (`OutputReceiver`); its Serve call to
        the LanguageModel carries cancellation and errors. Cancelling this (client disconnect)
        cancels that call, which aborts the engine request. `image_embeds` are ObjectRefs, passed
        at the top level so Ray hands the LM the arrays straight from the object store."""
        receiver = await self.output_receiver()
        address = await receiver.start()
        outputs = receiver.open(request.request_id, request.sampling.logprobs)
        call = self.lm.generate_to.remote(request, address, *image_embeds)
        watch_call(call, outputs)
        finished = False
        try:
            while (deltas := await outputs.next()) is not None:
                for delta in deltas:
                    trace.delta(delta.num_tokens)
                    if delta.finish_reason == "error":
                        raise engine_error(request.request_id, delta.index)
                    yield delta
            finished = True
        except Exception as exc:
            trace.failed = True
            raise lm_failure(exc, request.request_id) from exc
        finally:
            receiver.close(request.request_id)
            if not finished:
                # Reaches the replica as CancelledError; LanguageModel.generate_to aborts it.
                call.cancel()

    async def output_receiver(self) -> OutputReceiver:
        """This replica's output channel, detokenizing with the engine's own tokenizer: made by
        the first request, which the requests arriving meanwhile wait for (one tokenizer load,
        not one per request of a first burst)."""
        if self.receiver is None:
            if self.making_receiver is None:
                self.making_receiver = asyncio.ensure_future(self.make_output_receiver())
            try:
                self.receiver = await asyncio.shield(self.making_receiver)
            except Exception:
                self.making_receiver = None  # the next request tries again
                raise
        return self.receiver

    async def make_output_receiver(self) -> OutputReceiver:
        from vllm.tokenizers import get_tokenizer

        info = await self.model_info()
        tokenizer = await asyncio.to_thread(
            get_tokenizer, info.tokenizer, tokenizer_mode=info.tokenizer_mode,
            trust_remote_code=info.trust_remote_code)
        return OutputReceiver(self.output_host or node_ip_address(), tokenizer)


def engine_error(request_id: str, index: int) -> APIError:
    """vLLM's `FinishReason.ERROR` (e.g. a grammar that refused the token it had allowed), which
    vLLM's own server always answers as a 500; never a choice in a 200."""
    return APIError(500, f"the engine ended choice {index} of request {request_id} with an "
                    "error; retry the request", type="internal_error", code="generation_failed")


def image_fan_in(vision: VisionConfig, preprocessor, encoder, model_path: str,
                 tokenizer) -> ImageFanIn:
    """With `handover: encoder_cache` each image's prompt text is the model's own placeholder
    text (vLLM's `get_placeholder_str`), and an image counts the tokens vLLM's processor writes
    around its pads too."""
    if vision.handover != "encoder_cache":
        return ImageFanIn(vision.image_placeholder, preprocessor, encoder)
    from moonserve.pipeline.engine.image_format import image_format

    fmt = image_format(model_path)

    def extra_tokens(width: int, height: int) -> int:
        return sum(len(tokenizer.encode(text, add_special_tokens=False))
                   for text in fmt.wrapper(width, height))

    return ImageFanIn(vision.image_placeholder, preprocessor, encoder, fmt.placeholder_text,
                      engine_cache=True, extra_tokens=extra_tokens)


def template_tokens(prompts: PromptBuilder) -> int | None:
    """The chat template's tokens around one empty user turn (its default system prompt too),
    plus a margin: with a body's bytes, a bound on a text prompt's tokens before tokenizing.
    None when the template will not render that."""
    try:
        return len(prompts.chat_prompt_ids([ChatMessage(role="user", content="")])) + 8
    except Exception:  # noqa: BLE001 - no bound: nothing is refused early
        return None


def watch_call(call, outputs: RequestOutputs) -> None:
    """End `outputs` with the call's failure; a call that succeeds but whose last delta never
    arrives (its connection dropped before any delta) ends them after `CHANNEL_GRACE_S`."""

    async def watch():
        try:
            await call
        except Exception as exc:
            outputs.fail(exc)
            return
        lost = ChannelLost(f"request {outputs.request_id}: the LanguageModel finished but its "
                           "outputs did not arrive")
        asyncio.get_running_loop().call_later(CHANNEL_GRACE_S, outputs.fail, lost)

    in_background(watch())


@dataclass
class Job:
    """A validated, tokenized request on its way to admission."""

    request_id: str
    body: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    info: ModelInfo
    prompt_param: str  # the field a context error names: "messages" or "prompt"
    chat: bool
    images: EncodingImages = field(default_factory=EncodingImages.none)
    image_embeds: list = field(default_factory=list)  # ObjectRefs, once encoded
    plan: ChatPlan | None = None  # chat only: constraint and output parsing
    # The Responses or Messages turn this chat request answers (its body's shape).
    turn: ResponsesTurn | MessagesTurn | None = None
    keep: Callable[[dict], Awaitable[None]] | None = None  # stores a Responses turn

    def full(self, completion: Completion) -> dict:
        """The response body of a finished answer."""
        if self.turn is not None:
            return self.turn.full(self.response_format().parser(0), completion)
        return self.response_format().full(completion)

    def stream_encoder(self):
        """StreamEncoder, or the turn's (`ResponsesStream`, `MessagesStream`)."""
        if self.turn is not None:
            return self.turn.stream_encoder(self.response_format().parser(0))
        return StreamEncoder(self.response_format(), self.body.include_usage(), self.body.n)

    def response_format(self) -> ResponseFormat:
        if self.plan is None:
            return ResponseFormat(self.request_id, self.info.name, chat=self.chat)
        return ResponseFormat(self.request_id, self.info.name, chat=self.chat,
                              parser=lambda index: self.plan.choice_parser(self.prompt_ids))


def authorization(request: Request) -> str | None:
    """The request's API key as an `Authorization` header: OpenAI clients send that one,
    Anthropic's send `x-api-key`."""
    header = request.headers.get("authorization")
    if header is None and (key := request.headers.get("x-api-key")):
        return f"Bearer {key}"
    return header


def page(items: list[dict], query) -> dict:
    """OpenAI's list page of `items` (stored in input order) for `limit`, `order`, `after`."""
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("limit: an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order: 'asc' or 'desc'", "order")
    items = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no item {after!r} in this response's input", "after")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def node_ip_address() -> str:
    """This node's address as Ray knows it: where LanguageModel replicas on any node reach us."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


class SlotStreamingResponse(StreamingResponse):
    """A stream that releases its lane slot when it ends, however it ends (done, error, client
    gone): Starlette always awaits the response object the endpoint returned."""

    def __init__(self, slot, trace: RequestTrace, content, **kwargs):
        super().__init__(content, **kwargs)
        self.slot = slot
        self.trace = trace

    async def __call__(self, scope, receive, send) -> None:
        ok = False
        try:
            await super().__call__(scope, receive, send)
            ok = True
        finally:
            self.slot.release()
            self.trace.finish(ok=ok)


async def api_error_response(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(error.body(), exc.status_code)
