"""The draft step message between vLLM's proposer and the DraftService.

One frame = a 4-byte big-endian length, then a msgpack map. After a `{"token": ...}` hello
(`moonserve.pipeline.speculative.endpoint`), the proposer sends, once per engine step, one `step` for the
whole batch and reads one reply with the same `seq`:

    step  = {"seq": int, "k": int,
             "rows": [[request_id, position, [new token ids]], ...],
             "release": [request_id, ...],          # left the batch since the last step
             "stats": {"calls": int, "skipped": int, "missed": int, "rtt_s": [float, ...]}}
    reply = {"seq": int, "drafts": [[token ids], ...],   # one per row, maybe empty
             "resend_from": [int, ...],                  # per row: -1, or where to resend from
             "error": str | None,
             "deadline_ms": float}                       # optional: the proposer's new deadline

`position` is how many context tokens the proposer believes the service holds (see
`moonserve.pipeline.speculative.sessions`); a row whose position is ahead of the service (lost call,
service restarted) comes back with `resend_from` and no drafts.

Example:
    >>> a, b = socket.socketpair()
    >>> send_frame(a, {"seq": 1})
    >>> FrameReader(b).read(timeout_s=1.0)
    {'seq': 1}
"""

from __future__ import annotations

import select
import socket
import struct
import time

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20


def send_frame(sock: socket.socket, message: dict) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    sock.sendall(HEADER.pack(len(payload)) + payload)


class FrameReader:
    """Reads whole frames from a stream socket, waiting at most a given time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray()

    def read(self, timeout_s: float | None) -> dict | None:
        """The next frame; None when none is complete within `timeout_s` (None: wait forever).

        Raises ConnectionError when the peer closed the connection.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (frame := self._pop()) is None:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("draft connection closed by the peer")
            self.buffer += chunk
        return frame

    def _pop(self) -> dict | None:
        if len(self.buffer) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.buffer)
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"draft frame of {size} bytes is over {MAX_FRAME_BYTES}")
        if len(self.buffer) < HEADER.size + size:
            return None
        payload = bytes(self.buffer[HEADER.size:HEADER.size + size])
        del self.buffer[:HEADER.size + size]
        return msgpack.unpackb(payload, raw=False)
