"""The Router replica's side of the output channel (`moonserve.pipeline.engine.output_wire`): the
Router is vLLM's frontend for its own requests' outputs.

The Router listens on one TCP port; each LanguageModel replica connects once and sends, for this
Router's requests, each request's EngineCoreRequest and then every engine step's outputs as one
frame. `OutputReceiver` runs them through one vLLM `OutputProcessor` (incremental detokenizing,
stop strings, logprobs, n > 1 choices: vLLM's own code, once per token) and hands each request's
`RequestOutputs` its deltas; the requests a stop string ended go back to the LanguageModel over
the same connection to be aborted in the engine, as vLLM's frontend aborts them. A request's own
Serve call to the LanguageModel (`generate_to`) still carries its cancellation and its errors: the
Router cancels it when the client goes away, and a failure of that call (or of the connection its
outputs came over) ends the request's outputs with that error.

Example (inside the Router's event loop):
    >>> receiver = OutputReceiver("127.0.0.1", tokenizer)
    >>> address = await receiver.start()                                  # doctest: +SKIP
    >>> outputs = receiver.open("r1", num_logprobs=None)                  # doctest: +SKIP
    >>> call = lm.generate_to.remote(request, address)                    # doctest: +SKIP
    >>> while (deltas := await outputs.next()) is not None: ...           # doctest: +SKIP
    >>> receiver.close("r1")                                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from moonserve.pipeline.engine.output_wire import (
    ABORT,
    OUTPUTS,
    REQUEST,
    TOKEN_BYTES,
    ChannelAddress,
    FrameError,
    FrameReader,
    WireDecoders,
    WireEncoder,
    encode_frame,
    fan_out,
)
from moonserve.pipeline.api.protocol import GenerationDelta, TokenLogprob, merge_deltas

logger = logging.getLogger("moonserve.router")


class ChannelLost(ConnectionError):
    """The connection a request's outputs came over closed before its last output."""


class RequestOutputs:
    """One request's deltas as they arrive; `next()` returns all that are waiting, merged per
    choice (one event per request per step, fewer when the reader is behind). `num_logprobs`:
    alternatives per token the request asked for (None: no logprobs)."""

    def __init__(self, request_id: str, num_logprobs: int | None = None):
        self.request_id = request_id
        self.num_logprobs = num_logprobs
        self.pending: list[GenerationDelta] = []
        self.finished = False  # the last delta has arrived
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.connection: ChannelConnection | None = None  # the one its outputs come over

    def put(self, delta: GenerationDelta) -> None:
        self.pending.append(delta)
        self.finished = self.finished or delta.finished
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End with `error` unless every delta is already here (a late failure changes nothing)."""
        if not self.finished and self.error is None:
            self.error = error
            self._wake()

    async def next(self) -> list[GenerationDelta] | None:
        """The deltas that arrived since the last call; None after the last one; raises the
        request's error once the deltas before it are read."""
        while not self.pending:
            if self.finished:
                return None
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        deltas, self.pending = self.pending, []
        return merge_deltas(deltas)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def deltas_of(output, num_logprobs: int | None) -> list[GenerationDelta]:
    """vLLM's RequestOutput (output kind DELTA) as one GenerationDelta per choice that has news;
    the last one marks the request finished."""
    num_prompt_tokens = len(output.prompt_token_ids or ())
    num_cached = output.num_cached_tokens or 0
    num_written = output.num_cache_creation_tokens or 0
    deltas = [GenerationDelta(
        text=completion.text,
        num_tokens=len(completion.token_ids),
        num_prompt_tokens=num_prompt_tokens,
        finish_reason=completion.finish_reason,
        logprobs=token_logprobs(completion.token_ids, completion.logprobs, num_logprobs),
        index=completion.index,
        token_ids=list(completion.token_ids),
        num_cached_tokens=num_cached,
        num_cache_write_tokens=num_written,
        stop_string=completion.stop_reason if isinstance(completion.stop_reason, str) else None,
    ) for completion in output.outputs]
    if output.finished:
        deltas = deltas or [GenerationDelta("", 0, num_prompt_tokens)]
        deltas[-1].finished = True
    return deltas


def token_logprobs(token_ids, logprobs, num_top: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-token {token id: Logprob} maps as `TokenLogprob`s: the sampled token's, and its
    `num_top` most likely alternatives (vLLM's map holds the top ones plus the sampled one)."""
    if num_top is None or logprobs is None:
        return None
    out = []
    for token_id, candidates in zip(token_ids, logprobs):
        sampled = candidates[token_id]
        top = sorted((c for c in candidates.values() if c.rank is not None and c.rank <= num_top),
                     key=lambda c: c.rank)
        out.append(TokenLogprob.of(sampled.decoded_token or "", sampled.logprob,
                                   ((c.decoded_token or "", c.logprob) for c in top)))
    return out


class OutputReceiver:
    """The Router's listening socket, vLLM's OutputProcessor for the requests whose outputs come
    over it, and those requests' `RequestOutputs`."""

    def __init__(self, host: str, tokenizer):
        from vllm.v1.engine.output_processor import OutputProcessor

        self.host = host
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.processor = OutputProcessor(tokenizer, log_stats=False)
        self.requests: dict[str, RequestOutputs] = {}
        self.address: ChannelAddress | None = None
        self.server: asyncio.Server | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> ChannelAddress:
        """Listen (once; later calls return the address)."""
        if self.address is not None:
            return self.address
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self.address is None:
                loop = asyncio.get_running_loop()
                self.server = await loop.create_server(lambda: ChannelConnection(self),
                                                       self.host, 0)
                port = self.server.sockets[0].getsockname()[1]
                self.address = ChannelAddress(self.host, port, self.token)
        return self.address

    def open(self, request_id: str, num_logprobs: int | None = None) -> RequestOutputs:
        outputs = self.requests[request_id] = RequestOutputs(request_id, num_logprobs)
        return outputs

    def close(self, request_id: str) -> None:
        """The request has ended here (done, failed, or its client left)."""
        self.requests.pop(request_id, None)
        self.processor.abort_requests([request_id], internal=False)

    def add_request(self, request, connection: ChannelConnection) -> None:
        """A request's EngineCoreRequest, before its first output: the OutputProcessor's state
        for each of its choices (vLLM's fan-out, as the engine got it)."""
        outputs = self.requests.get(request.external_req_id)
        if outputs is None:
            return  # it has ended (client gone); its call is being cancelled
        outputs.connection = connection
        parent, children = fan_out(request)
        for index, child in enumerate(children):
            self.processor.add_request(child, None, parent, index, None)

    def process(self, outputs, connection: ChannelConnection) -> None:
        """One engine step's outputs: vLLM's output processing, each request its deltas, and
        the requests a stop string ended aborted in the engine."""
        processed = self.processor.process_outputs(outputs.outputs, outputs.timestamp)
        for output in processed.request_outputs:
            request = self.requests.get(output.request_id)
            if request is not None:
                for delta in deltas_of(output, request.num_logprobs):
                    request.put(delta)
        if processed.reqs_to_abort:
            connection.send_abort(processed.reqs_to_abort)

    def lost(self, connection: ChannelConnection, reason: str) -> None:
        """Requests whose outputs came over `connection` end with `ChannelLost` (those with none
        yet end when their call fails: the replica is gone)."""
        for outputs in list(self.requests.values()):
            if outputs.connection is connection:
                outputs.fail(ChannelLost(f"the LanguageModel's output channel closed: {reason}"))

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()


class ChannelConnection(asyncio.Protocol):
    """One LanguageModel replica's connection."""

    def __init__(self, receiver: OutputReceiver):
        self.receiver = receiver
        self.reader = FrameReader(receiver.token)
        self.decoders = WireDecoders()
        self.encoder = WireEncoder()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for kind, body in self.reader.feed(data):
                self.handle(kind, self.decoders.decode(kind, body))
        except FrameError as exc:
            logger.warning("output channel from %s closed: %s",
                           self.transport.get_extra_info("peername"), exc)
            self.transport.close()

    def handle(self, kind: int, obj) -> None:
        if kind == REQUEST:
            self.receiver.add_request(obj, self)
        elif kind == OUTPUTS:
            self.receiver.process(obj, self)
        else:
            raise FrameError(f"a LanguageModel sent a frame of kind {kind}")

    def send_abort(self, request_ids: list[str]) -> None:
        if not self.transport.is_closing():
            self.transport.write(encode_frame(self.encoder, ABORT, list(request_ids)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver.lost(self, repr(exc) if exc else "closed by the LanguageModel")
