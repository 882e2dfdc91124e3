"""The output channel between a LanguageModel replica and a Router replica (issue 31).

The LanguageModel replica hosts the engine and sends what vLLM's engine core produced in each step
for all of one Router's requests as one frame: vLLM's own `EngineCoreOutputs` (new token ids,
logprobs, finish reasons), encoded by vLLM's own `MsgpackEncoder`, as the engine core sends them
to a vLLM frontend. The Router is that frontend: it runs vLLM's `OutputProcessor` (incremental
detokenizing, stop strings, logprobs) once per token, and asks the engine, over the same
connection, to abort the requests a stop string ended. Before a request's first output the
LanguageModel sends the `EngineCoreRequest` its input processor made (what the OutputProcessor
needs of it: ids, sampling parameters, prompt length), so each token is processed by one frontend.

One TCP connection per (LanguageModel replica, Router replica) pair. The Router listens; the
LanguageModel connects on the first request naming the Router's `ChannelAddress`, sends the
address's token, then frames:

    frame   = 4-byte big-endian length | 1-byte kind | body
    body    = 2-byte count n | n x 4-byte buffer length | the n buffers (vLLM's MsgpackEncoder:
              one msgpack buffer, then any out-of-band array buffers)
    kinds   = REQUEST (an EngineCoreRequest, LanguageModel -> Router),
              OUTPUTS (EngineCoreOutputs, LanguageModel -> Router),
              ABORT (request ids, Router -> LanguageModel)

The reader checks the token before it reads any frame, and a frame's length before its body.

Example:
    >>> address = ChannelAddress("127.0.0.1", 9000, b"k" * TOKEN_BYTES)
    >>> reader = FrameReader(address.token)
    >>> data = address.token + encode_frame(WireEncoder(), ABORT, ["r1", "r2"])
    >>> [(kind, WireDecoders().decode(kind, body)) for kind, body in reader.feed(data)]
    [(3, ['r1', 'r2'])]
"""

from __future__ import annotations

import copy
import hmac
from dataclasses import dataclass

TOKEN_BYTES = 16
HEADER_BYTES = 5  # length, kind
# A step's outputs for one Router (a few hundred bytes per request, more with logprobs), or one
# request's prompt ids (up to the context: 4 bytes a token); anything near this is not a frame.
MAX_FRAME_BYTES = 64 * 1024 * 1024
REQUEST, OUTPUTS, ABORT = 1, 2, 3


class FrameError(ValueError):
    """The peer is not a part of this app (wrong token) or sent a malformed frame."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a Router replica receives its outputs; sent with each request it forwards."""

    host: str
    port: int
    token: bytes


class WireEncoder:
    """vLLM's MsgpackEncoder (arrays out of band, as the engine core sends them)."""

    def __init__(self):
        from vllm.v1.serial_utils import MsgpackEncoder

        self.encoder = MsgpackEncoder()

    def encode(self, obj) -> list:
        return list(self.encoder.encode(obj))


class WireDecoders:
    """One vLLM MsgpackDecoder per frame kind."""

    def __init__(self):
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder

        self.decoders = {REQUEST: MsgpackDecoder(EngineCoreRequest),
                         OUTPUTS: MsgpackDecoder(EngineCoreOutputs),
                         ABORT: MsgpackDecoder(list[str])}

    def decode(self, kind: int, body: memoryview):
        decoder = self.decoders.get(kind)
        if decoder is None:
            raise FrameError(f"unknown frame kind {kind}")
        try:
            return decoder.decode(split_buffers(body))
        except Exception as exc:  # msgspec's and vLLM's decode errors alike
            raise FrameError(f"malformed frame of kind {kind}: {exc}") from exc


def encode_frame(encoder: WireEncoder, kind: int, obj) -> bytes:
    buffers = [memoryview(b).cast("B") for b in encoder.encode(obj)]
    head = len(buffers).to_bytes(2, "big") + b"".join(
        len(b).to_bytes(4, "big") for b in buffers)
    size = 1 + len(head) + sum(len(b) for b in buffers)
    return b"".join([size.to_bytes(4, "big"), kind.to_bytes(1, "big"), head, *buffers])


def split_buffers(body: memoryview) -> list[memoryview]:
    count = int.from_bytes(body[:2], "big")
    sizes = [int.from_bytes(body[2 + 4 * i:6 + 4 * i], "big") for i in range(count)]
    start, out = 2 + 4 * count, []
    for size in sizes:
        out.append(body[start:start + size])
        start += size
    if start != len(body):
        raise FrameError(f"frame buffers add up to {start} bytes, not its {len(body)}")
    return out


class FrameReader:
    """Incremental reader for one connection: `feed` the bytes received, get whole frames as
    (kind, body) pairs (`WireDecoders.decode` turns a body into its object)."""

    def __init__(self, token: bytes | None):
        self.token = token  # None: the side that connected (its peer sends no token)
        self.authenticated = token is None
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, memoryview]]:
        self.buffer += data
        if not self.authenticated and not self._check_token():
            return []
        frames, start = [], 0
        while len(self.buffer) - start >= HEADER_BYTES:
            size = int.from_bytes(self.buffer[start:start + 4], "big")
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
            end = start + 4 + size
            if len(self.buffer) < end:
                break
            kind = self.buffer[start + 4]
            frames.append((kind, memoryview(bytes(self.buffer[start + 5:end]))))
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


def fan_out(request):
    """vLLM's parallel sampling, as `AsyncLLM.add_request` does it: n > 1 becomes n child
    EngineCoreRequests under a `ParentRequest` (child i samples with seed + i). Both ends of the
    channel run it on the same request and get the same ids. Returns (parent or None, children).
    """
    from vllm.v1.engine.parallel_sampling import ParentRequest

    params = request.sampling_params
    if params is None or params.n == 1:
        return None, [request]
    parent = ParentRequest(request)
    children = []
    for index in range(params.n):
        child_id, child_params = parent.get_child_info(index)
        child = copy.copy(request)
        child.request_id = child_id
        child.sampling_params = child_params
        children.append(child)
    return parent, children


def for_the_router(request):
    """The EngineCoreRequest without what only the engine reads: the Router's OutputProcessor
    needs its ids, sampling parameters and prompt. Multimodal features are left out, and
    prompt embeddings kept as their shape only ([rows, 0]: the prompt's length, no values)."""
    lite = copy.copy(request)
    lite.mm_features = None
    if lite.prompt_embeds is not None:
        lite.prompt_embeds = lite.prompt_embeds.new_empty((lite.prompt_embeds.shape[0], 0))
    return lite
