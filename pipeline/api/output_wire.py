"""The LanguageModel -> Router output channel's wire format.

One TCP connection per (LanguageModel replica, Router replica) pair carries every engine step's
new tokens for all of that Router's requests as one frame, instead of one Ray streaming item per
request per token (issue 18). The Router listens; a LanguageModel replica connects when it gets
the first request naming the Router's `ChannelAddress`, sends the address's token, then frames:

    frame = 4-byte big-endian length | msgpack [[request_id, GenerationDelta], ...]

The reader checks the token before it reads any frame, and a frame's length before its body.

Example:
    >>> address = ChannelAddress("127.0.0.1", 9000, b"k" * TOKEN_BYTES)
    >>> reader = FrameReader(address.token)
    >>> data = address.token + encode_frame(FrameEncoder(), [("r1", GenerationDelta("hi", 1, 3))])
    >>> [[(rid, d.text) for rid, d in frame] for frame in reader.feed(data)]
    [[('r1', 'hi')]]
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import msgspec

from moonserve.pipeline.api.protocol import GenerationDelta

TOKEN_BYTES = 16
HEADER_BYTES = 4
# A step's frame holds one delta per request of one Router (a few hundred bytes each, more with
# logprobs); anything near this is not a frame.
MAX_FRAME_BYTES = 16 * 1024 * 1024

FrameItems = list[tuple[str, GenerationDelta]]
FrameEncoder = msgspec.msgpack.Encoder


class FrameError(ValueError):
    """The peer is not a LanguageModel of this app (wrong token) or sent a malformed frame."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a Router replica receives its outputs; sent with each request it forwards."""

    host: str
    port: int
    token: bytes


def encode_frame(encoder: FrameEncoder, items: FrameItems) -> bytes:
    body = encoder.encode(items)
    return len(body).to_bytes(HEADER_BYTES, "big") + body


class FrameReader:
    """Incremental reader for one connection: `feed` the bytes received, get whole frames."""

    def __init__(self, token: bytes):
        self.token = token
        self.authenticated = False
        self.buffer = bytearray()
        self.decoder = msgspec.msgpack.Decoder(FrameItems)

    def feed(self, data: bytes) -> list[FrameItems]:
        self.buffer += data
        if not self.authenticated and not self._check_token():
            return []
        frames, start = [], 0
        while len(self.buffer) - start >= HEADER_BYTES:
            size = int.from_bytes(self.buffer[start:start + HEADER_BYTES], "big")
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
            end = start + HEADER_BYTES + size
            if len(self.buffer) < end:
                break
            try:
                frames.append(self.decoder.decode(self.buffer[start + HEADER_BYTES:end]))
            except msgspec.DecodeError as exc:
                raise FrameError(f"malformed frame: {exc}") from exc
            start = end
        del self.buffer[:start]
        return frames

    def _check_token(self) -> bool:
        if len(self.buffer) < TOKEN_BYTES:
            return False
        if not hmac.compare_digest(bytes(self.buffer[:TOKEN_BYTES]), self.token):
            raise FrameError("wrong channel token")
        del self.buffer[:TOKEN_BYTES]
        self.authenticated = True
        return True
