"""The LanguageModel replica's side of the output channel (`moonserve.pipeline.api.output_wire`).

Each request's deltas are pushed to the sender of the Router that forwarded it; the sender writes
everything pushed during one turn of the event loop as one frame. vLLM's output handler wakes every
request of an engine step in the same turn, so a step's tokens for one Router leave in one write.

Example (inside a replica's event loop):
    >>> senders = OutputSenders()
    >>> await send_outputs(senders, address, "r1", lm.generate(request))   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from moonserve.pipeline.api.output_wire import (
    ChannelAddress,
    FrameEncoder,
    FrameItems,
    encode_frame,
)
from moonserve.pipeline.api.protocol import GenerationDelta

# Bytes a Router may leave unread before a request's sender waits for it; meanwhile vLLM merges
# that request's deltas (RequestOutputKind.DELTA), so a slow Router slows only its own streams.
HIGH_WATER_BYTES = 1024 * 1024


class OutputSender:
    """One connection to one Router replica."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.encoder = FrameEncoder()
        self.pending: FrameItems = []

    @classmethod
    async def connect(cls, address: ChannelAddress) -> OutputSender:
        _, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(address.token)
        return cls(writer)

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    def push(self, request_id: str, delta: GenerationDelta) -> None:
        if self.closed:
            raise ConnectionResetError("the Router's output channel is closed")
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append((request_id, delta))

    def flush(self) -> None:
        items, self.pending = self.pending, []
        if items and not self.closed:
            self.writer.write(encode_frame(self.encoder, items))

    @property
    def backed_up(self) -> bool:
        """The Router has left more than `HIGH_WATER_BYTES` unread."""
        return self.writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES

    def close(self) -> None:
        self.writer.close()


class OutputSenders:
    """The replica's connections, one per Router address, opened on first use."""

    def __init__(self):
        self.senders: dict[ChannelAddress, asyncio.Future[OutputSender]] = {}

    async def get(self, address: ChannelAddress) -> OutputSender:
        connecting = self.senders.get(address)
        if connecting is None or not usable(connecting):
            connecting = self.senders[address] = asyncio.ensure_future(
                OutputSender.connect(address))
        return await asyncio.shield(connecting)

    def close(self) -> None:
        for connecting in self.senders.values():
            if connecting.done() and usable(connecting):
                connecting.result().close()
            connecting.cancel()
        self.senders.clear()


def usable(connecting: asyncio.Future[OutputSender]) -> bool:
    """Still connecting, or connected and open (not failed, not closed by the Router)."""
    if not connecting.done():
        return True
    return not connecting.cancelled() and connecting.exception() is None and \
        not connecting.result().closed


async def send_outputs(senders: OutputSenders, address: ChannelAddress, request_id: str,
                       deltas: AsyncIterator[GenerationDelta]) -> int:
    """Push a request's deltas to its Router; returns the number of output tokens. Errors and
    cancellation pass through to the caller (the Router's call), so `deltas` ends early and the
    LanguageModel aborts the engine request."""
    num_tokens = 0
    async with aclosing(deltas):  # closed at once when this call fails or is cancelled
        sender = await senders.get(address)
        try:
            async for delta in deltas:
                sender.push(request_id, delta)
                num_tokens += delta.num_tokens
                if sender.backed_up:  # checked inline: no coroutine per token when it is not
                    await sender.writer.drain()
        except Exception:
            # The deltas before the failure leave before the failure does (it goes back over
            # Ray), so the Router streams them before the error event.
            sender.flush()
            raise
    return num_tokens
