"""The draft path's sockets: the DraftService's step server, and the LM replica's resolver.

vLLM runs the proposer in its worker processes, which are not Ray workers and cannot hold a Serve
handle; and a Serve handle call costs milliseconds per engine step on a busy node. So the step
messages (`moonserve.pipeline.speculative.wire`) go over one ZeroMQ connection from the proposer
straight to the DraftService replica (a DEALER socket talking to a ROUTER):

- `StepServer` (in the DraftService replica): a ROUTER on the node's address, served by one thread.
  A proposer connects with the PLAIN mechanism, its password the secret from `endpoint()`; pyzmq's
  ZAP authenticator refuses any other during the handshake, so the handler only sees steps from
  proposers that were told the secret, and nothing past the handshake's few hundred bytes is read
  before the secret is checked. A message over `MAX_STEP_BYTES` drops its connection unread (zmq's
  `maxmsgsize`; the proposer then resolves and reconnects). Each step gets its reply, and the work
  a handler defers (the prefetch) runs right after the reply is queued, on the same thread, while
  the target verifies.
- `EndpointResolver` (in the LanguageModel replica): a ROUTER on a Unix socket (`ipc://`) whose
  path is in `MOONSERVE_DRAFT_SOCKET`; the proposer asks it `EndpointQuery(stale=old, shard=i)`
  and it answers the current `EndpointAnswer(endpoint="host:port", token=...)` of that shard's
  replica (one shard unless the DraftService has several replicas:
  `moonserve.pipeline.speculative.shards`), asking Serve (through the handle) only when it has
  none, the proposer reports the one it has as stale (the replica was replaced), or, sharded,
  every `REFRESH_S`. Serve thus still owns placement and restarts; it is just off the per-step
  path. Built on the replica's event loop, it makes each handle call there (the resolver's own
  thread only waits): with `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`, Serve routes a handle's
  calls on the loop that makes them, and a thread without one cannot call it at all.
- `connect_step_socket`: the proposer's side of the step connection, with a monitor socket that
  says when the handshake succeeded and when the connection is lost (`LOST`).

Example:
    >>> server = StepServer(lambda m: ({"seq": m["seq"], "drafts": [], "resend_from": []}, None),
    ...                     host="127.0.0.1")
    >>> server.start()
    >>> server.endpoint()["endpoint"]
    '127.0.0.1:41234'
    >>> server.close()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from moonserve.pipeline.speculative.shards import REFRESH_S
from moonserve.pipeline.speculative.wire import (
    EndpointAnswer,
    EndpointQuery,
    StepReply,
    StepRequest,
)

logger = logging.getLogger("moonserve.draft_endpoint")
# Handler: the step as plain Python (wire format) -> (reply, work to run after it is sent or None)
StepHandler = Callable[[dict], tuple[dict, Callable[[], object] | None]]
# The proposer's PLAIN user name; its password is the step server's token.
PLAIN_USERNAME = "proposer"
# The largest step message read: a first step sends a request's whole context (about 5 bytes a
# token), so this holds a batch with a few 1M-token contexts.
MAX_STEP_BYTES = 64 << 20
# A step connection neither connected nor refused by then counts as lost (no step waits for it).
CONNECT_TIMEOUT_S = 1.0
# Monitor events after which a step connection is gone (zmq does not redial: see below).
LOST = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_MONITOR_STOPPED)


_monitor_ids = itertools.count()


class _RouterServer:
    """A ROUTER socket served by one daemon thread: each message gets `answer(payload)`'s reply,
    then the work it returned runs. `close` unbinds and drops every connection."""

    def __init__(self, name: str):
        self.name = name
        self.context = zmq.Context(io_threads=1)
        self.context.setsockopt(zmq.LINGER, 0)  # close() drops unsent replies
        self.sock = self.context.socket(zmq.ROUTER)
        self.monitor: zmq.Socket | None = None  # a subclass may watch its connections
        self.thread: threading.Thread | None = None
        self.closed = False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Returns once the serving thread has closed its socket (after the message at hand)."""
        if self.closed:
            return
        self.closed = True
        if self.thread is None:
            self._close_sockets()
        # Terminating the context makes the serving thread's poll raise ContextTerminated.
        self.context.term()

    def answer(self, payload: bytes) -> tuple[bytes, Callable[[], object] | None]:
        raise NotImplementedError

    def on_event(self, event: dict) -> None:
        """One event of `self.monitor`."""

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in filter(None, (self.sock, self.monitor)):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.monitor in ready:
                    self.on_event(recv_monitor_message(self.monitor))
                if self.sock in ready:
                    frames = self.sock.recv_multipart()  # [peer identity, payload]
                    reply, after = self.answer(frames[-1])
                    self.sock.send_multipart([frames[0], reply])
                    if after is not None:
                        _run_logged(after)
        except zmq.ContextTerminated:
            pass
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self.sock.close()
        if self.monitor is not None:
            self.monitor.close()


class StepServer(_RouterServer):
    """The DraftService's step server (see module doc); `handler` runs on its one thread."""

    def __init__(self, handler: StepHandler, host: str, max_message_bytes: int = MAX_STEP_BYTES):
        super().__init__("draft-steps")
        self.handler = handler
        self.host = host
        self.token = secrets.token_hex(16)
        self.auth = ThreadAuthenticator(self.context)
        self.auth.start()
        self.auth.configure_plain(domain="*", passwords={PLAIN_USERNAME: self.token})
        self.sock.plain_server = True
        self.sock.maxmsgsize = max_message_bytes
        self.sock.bind(f"tcp://{host}:*")
        self.port = int(self.sock.last_endpoint.decode().rsplit(":", 1)[1])
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepRequest)

    def endpoint(self) -> dict:
        return {"endpoint": f"{self.host}:{self.port}", "token": self.token}

    def close(self) -> None:
        if not self.closed:
            self.auth.stop()
        super().close()

    def answer(self, payload: bytes) -> tuple[bytes, Callable[[], object] | None]:
        """The handler's reply; a step that fails (bad message, handler error) gets an `error`
        reply, so the proposer resends its rows and the next step drafts again."""
        try:
            request = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("unreadable draft step: %s", e)
            return self._error(_seq_of(payload), e), None
        try:
            reply, after = self.handler(msgspec.to_builtins(request, builtin_types=(bytes,)))
            return self.encoder.encode(msgspec.convert(reply, StepReply)), after
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
            logger.exception("draft step %d failed", request.seq)
            return self._error(request.seq, e), None

    def _error(self, seq: int, e: Exception) -> bytes:
        return self.encoder.encode(StepReply(seq=seq, error=f"{type(e).__name__}: {e}"))

    def on_event(self, event: dict) -> None:
        if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # MONITOR_STOPPED, as the server closes
        logger.warning("draft step connection from %s refused: wrong or missing token",
                       event["endpoint"].decode(errors="replace"))


def _run_logged(work: Callable[[], object]) -> None:
    """Deferred work (the prefetch): a failure is logged, and the server goes on serving."""
    try:
        work()
    except Exception:  # noqa: BLE001 - the step was answered; only its prefetch is lost
        logger.exception("deferred draft work failed")


class _Seq(msgspec.Struct):
    seq: int = 0


def _seq_of(payload: bytes) -> int:
    """The `seq` of a step that does not fit its schema, so its error reply reaches the caller."""
    try:
        return msgspec.msgpack.decode(payload, type=_Seq).seq
    except msgspec.DecodeError:
        return 0


class EndpointResolver(_RouterServer):
    """Answers the proposer's endpoint queries from the DraftService handle (see module doc).

    With `shards` above 1 it answers per shard (`endpoint(shard)`, which the DraftService's
    `ShardRouter` sends to that shard's replica) and asks Serve again once an answer is
    `refresh_s` old, so a shard moves back to its replica after a restart. Made inside a running
    event loop (the replica's), it calls the handle on that loop."""

    def __init__(self, handle, timeout_s: float, shards: int = 1, refresh_s: float = REFRESH_S):
        super().__init__("draft-resolver")
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.dir = Path(tempfile.mkdtemp(prefix="moonserve-draft-"))  # 0700: this user only
        self.path = str(self.dir / "resolver.sock")
        self.sock.bind(f"ipc://{self.path}")
        self.handle = handle
        self.timeout_s = timeout_s
        self.shards = shards
        self.refresh_s = refresh_s
        self.current: dict[int, tuple[EndpointAnswer, float]] = {}  # shard -> (answer, when)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EndpointQuery)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def resolve(self, stale: str | None, shard: int = 0) -> EndpointAnswer:
        known = self.current.get(shard)
        now = time.monotonic()
        if known is None or known[0].endpoint == stale or \
                (self.shards > 1 and now - known[1] >= self.refresh_s):
            self.current.pop(shard, None)
            try:
                found = msgspec.convert(self._ask(shard), EndpointAnswer)
            except Exception as e:  # noqa: BLE001 - the service is down or restarting
                logger.warning("draft service endpoint unavailable: %s: %s", type(e).__name__, e)
                return EndpointAnswer(error=f"{type(e).__name__}: {e}")
            self.current[shard] = (found, now)
        return self.current[shard][0]

    def _call(self, shard: int):
        return self.handle.endpoint.remote(shard) if self.shards > 1 else \
            self.handle.endpoint.remote()

    def _ask(self, shard: int):
        """The handle's answer, asked on `self.loop` when there is one; raises TimeoutError."""
        if self.loop is None:
            return self._call(shard).result(timeout_s=self.timeout_s)

        async def ask():
            return await self._call(shard)

        future = asyncio.run_coroutine_threadsafe(ask(), self.loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def answer(self, payload: bytes) -> tuple[bytes, None]:
        try:
            query = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            return self.encoder.encode(EndpointAnswer(error=f"bad endpoint query: {e}")), None
        if not 0 <= query.shard < self.shards:
            return self.encoder.encode(EndpointAnswer(
                error=f"no shard {query.shard}: the DraftService has {self.shards}")), None
        return self.encoder.encode(self.resolve(query.stale, query.shard)), None


def connect_step_socket(context: zmq.Context, answer: EndpointAnswer) -> tuple[zmq.Socket,
                                                                               zmq.Socket]:
    """The proposer's DEALER to the step server at `answer`, and its monitor socket: it reports
    `EVENT_HANDSHAKE_SUCCEEDED` once steps can be sent, or one of `LOST`. Connecting happens in
    zmq's I/O thread; nothing here waits."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.plain_username = PLAIN_USERNAME.encode()
    sock.plain_password = answer.token.encode()
    sock.immediate = True  # queue steps only on a finished handshake: a send never waits
    sock.reconnect_ivl = -1  # a lost service is resolved again (it may have moved), not redialed
    sock.connect_timeout = sock.handshake_ivl = int(CONNECT_TIMEOUT_S * 1000)
    # A name of our own: pyzmq's default one reuses the file descriptor number, which the socket
    # this one replaces may still hold while its monitor shuts down.
    address = f"inproc://moonserve-draft-monitor-{next(_monitor_ids)}"
    sock.monitor(address, zmq.EVENT_HANDSHAKE_SUCCEEDED | LOST)
    monitor = context.socket(zmq.PAIR)
    monitor.connect(address)
    sock.connect(f"tcp://{answer.endpoint}")
    return sock, monitor
