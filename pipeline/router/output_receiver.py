"""The Router replica's side of the output channel (`moonserve.pipeline.api.output_wire`).

The Router listens on one TCP port; each LanguageModel replica connects once and sends every
engine step's deltas for this Router's requests as one frame, which is fanned out here to the
requests' `RequestOutputs`. A request's own Serve call to the LanguageModel (`generate_to`) still
carries its cancellation and its errors: the Router cancels it when the client goes away, and a
failure of that call (or of the connection its deltas came over) ends the request's outputs with
that error.

Example (inside the Router's event loop):
    >>> receiver = OutputReceiver("127.0.0.1")
    >>> address = await receiver.start()                                  # doctest: +SKIP
    >>> outputs = receiver.open("r1")                                     # doctest: +SKIP
    >>> call = lm.generate_to.remote(request, address)                    # doctest: +SKIP
    >>> while (deltas := await outputs.next()) is not None: ...           # doctest: +SKIP
    >>> receiver.close("r1")                                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from moonserve.pipeline.api.output_wire import (
    TOKEN_BYTES,
    ChannelAddress,
    FrameError,
    FrameReader,
)
from moonserve.pipeline.api.protocol import GenerationDelta, merge_deltas

logger = logging.getLogger("moonserve.router")


class ChannelLost(ConnectionError):
    """The connection a request's deltas came over closed before its last delta."""


class RequestOutputs:
    """One request's deltas as they arrive; `next()` returns all that are waiting, merged per
    choice (one event per request per step, fewer when the reader is behind)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.pending: list[GenerationDelta] = []
        self.finished = False  # the last delta has arrived
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.connection: ChannelConnection | None = None  # the one its deltas come over

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


class OutputReceiver:
    """The Router's listening socket and the requests waiting for outputs on it."""

    def __init__(self, host: str):
        self.host = host
        self.token = secrets.token_bytes(TOKEN_BYTES)
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

    def open(self, request_id: str) -> RequestOutputs:
        outputs = self.requests[request_id] = RequestOutputs(request_id)
        return outputs

    def close(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def deliver(self, items, connection: ChannelConnection) -> None:
        for request_id, delta in items:
            outputs = self.requests.get(request_id)
            if outputs is None:
                continue  # the request has ended (client gone); its call is being cancelled
            outputs.connection = connection
            outputs.put(delta)

    def lost(self, connection: ChannelConnection, reason: str) -> None:
        """Requests whose deltas came over `connection` end with `ChannelLost` (those with none
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
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except FrameError as exc:
            logger.warning("output channel from %s closed: %s",
                           self.transport.get_extra_info("peername"), exc)
            self.transport.close()
            return
        for items in frames:
            self.receiver.deliver(items, self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver.lost(self, repr(exc) if exc else "closed by the LanguageModel")
