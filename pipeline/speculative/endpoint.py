"""The draft path's sockets: the DraftService's step server, and the LM replica's resolver.

vLLM runs the proposer in its worker processes, which are not Ray workers and cannot hold a Serve
handle; and a Serve handle call costs milliseconds per engine step on a busy node. So the step
messages (`moonserve.pipeline.speculative.wire`) go over one plain TCP connection from the proposer straight
to the DraftService replica:

- `StepServer` (in the DraftService replica): listens on the node's address, one thread per
  connection; a connection must first send `{"token": ...}` (a secret from `endpoint()`), then each
  step message gets its reply, and the work a handler defers (the prefetch) runs right after the
  reply is sent, on the same thread, while the target verifies.
- `EndpointResolver` (in the LanguageModel replica): a Unix socket named by
  `MOONSERVE_DRAFT_SOCKET`; the proposer asks it `{"op": "endpoint", "stale": old}` and it answers
  the DraftService's current `{"endpoint": "host:port", "token": ...}`, asking Serve (through the
  handle) only when it has none or the proposer reports the one it has as stale (the replica was
  replaced). Serve thus still owns placement and restarts; it is just off the per-step path.

Example:
    >>> server = StepServer(lambda m: ({"seq": m["seq"]}, None), host="127.0.0.1")
    >>> server.start()
    >>> server.endpoint()["endpoint"]
    '127.0.0.1:41234'
"""

from __future__ import annotations

import hmac
import logging
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from moonserve.pipeline.speculative.wire import FrameReader, send_frame

logger = logging.getLogger("moonserve.draft_endpoint")
# Handler: message -> (reply, work to run after the reply is sent or None)
StepHandler = Callable[[dict], tuple[dict, Callable[[], object] | None]]


class _ThreadedServer:
    """Accept loop plus one daemon thread per connection; `close` drops them all."""

    def __init__(self, server: socket.socket, name: str):
        self.server = server
        self.name = name
        self.closed = threading.Event()
        self.connections: set[socket.socket] = set()

    def start(self) -> None:
        self.server.listen(64)
        threading.Thread(target=self._accept, name=self.name, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.server.close()
        for conn in list(self.connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve(self, conn: socket.socket, reader: FrameReader) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), name=f"{self.name}-conn",
                             daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        self.connections.add(conn)
        try:
            self.serve(conn, FrameReader(conn))
        except (ConnectionError, OSError):
            pass
        finally:
            self.connections.discard(conn)
            conn.close()


class StepServer(_ThreadedServer):
    def __init__(self, handler: StepHandler, host: str):
        sock = socket.create_server((host, 0))
        super().__init__(sock, "draft-steps")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.handler = handler
        self.host = host
        self.token = secrets.token_hex(16)

    def endpoint(self) -> dict:
        return {"endpoint": f"{self.host}:{self.server.getsockname()[1]}", "token": self.token}

    def serve(self, conn: socket.socket, reader: FrameReader) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = reader.read(timeout_s=10.0)
        if not hello or not hmac.compare_digest(str(hello.get("token", "")), self.token):
            logger.warning("draft step connection refused: wrong or missing token")
            return
        while not self.closed.is_set():
            reply, after = self.handler(reader.read(timeout_s=None))
            send_frame(conn, reply)
            if after is not None:
                after()


class EndpointResolver(_ThreadedServer):
    """Answers the proposer's endpoint queries from the DraftService handle (see module doc)."""

    def __init__(self, handle, timeout_s: float):
        self.dir = Path(tempfile.mkdtemp(prefix="moonserve-draft-"))
        self.path = str(self.dir / "resolver.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        super().__init__(sock, "draft-resolver")
        self.handle = handle
        self.timeout_s = timeout_s
        self.current: dict | None = None
        self.lock = threading.Lock()

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def resolve(self, stale: str | None) -> dict:
        with self.lock:
            if self.current is None or self.current["endpoint"] == stale:
                self.current = None
                try:
                    self.current = self.handle.endpoint.remote().result(timeout_s=self.timeout_s)
                except Exception as e:  # noqa: BLE001 - the service is down or restarting
                    logger.warning("draft service endpoint unavailable: %s: %s",
                                   type(e).__name__, e)
                    return {"error": f"{type(e).__name__}: {e}"}
            return dict(self.current)

    def serve(self, conn: socket.socket, reader: FrameReader) -> None:
        while not self.closed.is_set():
            query = reader.read(timeout_s=None)
            send_frame(conn, self.resolve(query.get("stale")))
