"""`ServiceProposer`: vLLM's `custom_class` proposer that takes its drafts from the DraftService.

vLLM (0.32, V1 model runner) constructs it in each worker with `vllm_config`, calls `load_model`
once, then `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`
synchronously every engine step; the returned lists (one per batch row) are the draft tokens its
rejection sampler verifies in the next step, so the output is the target's whatever they are.

Per step the proposer sends ONE message for the whole batch over a ZeroMQ connection straight to
the DraftService replica, whose address it gets from the resolver in the LM replica (a Unix socket
named by `MOONSERVE_DRAFT_SOCKET`; `moonserve.pipeline.speculative.endpoint`);
`moonserve.pipeline.speculative.wire` has the message schemas:

- Rows are mapped to request ids through the model runner's input batch (the runner is the frame
  that constructs this class), so the service keeps one context per request; each row sends only
  the tokens added since the proposer's last call for that request.
- Rows with nothing sampled this step (a prefill chunk) or at `max_model_len` get no drafts, as in
  vLLM's own ngram proposer. Requests that left the batch are released on the next message.
- Paused requests: a reply's `quiet` gives, per row, the steps its request will draft nothing for
  (the service's adaptive pause, `moonserve.pipeline.speculative.adaptive`). The request is left
  out of that many steps, its tokens wait for its next row, and a step with nothing to send makes
  no call: a request the drafter cannot help costs no round trip.
- Step cost: each decode step's time (call to call) against the tokens it verified feeds
  `StepCost`, and each message carries the acceptance a draft needs at this load
  (`StepRequest.min_acceptance`, b x tokens/s), by which the service sets each request's depth.
  The call's own round trip is part of the step's time, so a slow drafter raises it too.
- Deadline: the reply must come within `MOONSERVE_DRAFT_DEADLINE_MS` (or the deadline the service
  last sent, see `DraftService.set_deadline`), else the step drafts nothing.
  At most one call is in flight: while a late reply is outstanding (or the service is unreachable,
  or its address is being resolved, or the connection's handshake is under way), steps draft
  nothing WITHOUT waiting, so a dead DraftService costs decode one deadline, not one per step.
  The late reply is read and dropped when it comes; speculation resumes on the next step.
- Sharding: with a DraftService of N replicas (`MOONSERVE_DRAFT_SHARDS`), each request belongs to
  one shard by its id, and a step sends one message per shard (`ShardedDraftClient`), all in
  flight together; each shard is one `DraftClient` as above, its replica found by shard.
- Tensor parallelism: rank 0 calls and broadcasts its drafts over the TP group's CPU group, so every
  rank returns identical drafts. The other ranks wait at most as long as rank 0, never longer than
  the deadline.
- The target's hidden states (`MOONSERVE_DRAFT_HIDDEN_LAYERS`, for the `dspark_context` drafter):
  forward hooks on those decoder layers keep them (`HiddenCapture`); each row carries the ones
  the target accepted since the service last confirmed (`HiddenStates`).
- A step in which no request carries a draft samples with vLLM's plain sampler
  (`plain_sampling_without_drafts`): vLLM runs its rejection sampler on every step once any
  speculator is configured, drafts or none.

On GPUs vLLM runs model runner V2, which takes no proposer class: there `ServiceSpeculator`
(`speculator_v2.py`) speaks to the DraftService with the same bookkeeping (`DraftBook`).

Example (what vLLM does with it):
    >>> LLM(model, speculative_config={"method": "custom_class", "num_speculative_tokens": 4,
    ...     "model": "moonserve.pipeline.engine.proposer.ServiceProposer"})
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from moonserve.pipeline.speculative.adaptive import StepCost
from moonserve.pipeline.speculative.endpoint import connect_step_socket
from moonserve.pipeline.speculative.shards import REFRESH_S, shard_of
from moonserve.pipeline.speculative.wire import (
    EndpointAnswer,
    EndpointQuery,
    Row,
    StepReply,
    StepRequest,
    StepStats,
)

ENV_SOCKET = "MOONSERVE_DRAFT_SOCKET"
ENV_DEADLINE_MS = "MOONSERVE_DRAFT_DEADLINE_MS"
ENV_SHARDS = "MOONSERVE_DRAFT_SHARDS"  # the DraftService's replicas (requests sharded by id)
# "0,15,31": send the target's hidden states at these layers with each row (drafter
# `dspark_context`); unset or empty: tokens only.
ENV_HIDDEN_LAYERS = "MOONSERVE_DRAFT_HIDDEN_LAYERS"
DEFAULT_DEADLINE_MS = 25.0
# After a failed connection or an answer without a service, ask the resolver again this much later
# (steps in between draft nothing).
RECONNECT_INTERVAL_S = 1.0

logger = logging.getLogger("moonserve.proposer")


@dataclass
class ProposerStats:
    """Counted since the last message; sent with it (the DraftService exports them as metrics)."""

    calls: int = 0
    skipped: int = 0  # no call: the previous one is still pending, or no connection yet
    missed: int = 0  # the reply missed the deadline
    rtt_s: list[float] = field(default_factory=list)
    quiet: int = 0  # rows left out: their request was in an adaptive pause

    def take(self) -> StepStats:
        out = StepStats(self.calls, self.skipped, self.missed, self.rtt_s, self.quiet)
        self.calls = self.skipped = self.missed = self.quiet = 0
        self.rtt_s = []
        return out


class DraftClient:
    """The proposer's connection to the DraftService; at most one call in flight, never waiting
    longer than the deadline.

    The DraftService's address comes from the LM replica's resolver (a Unix socket, see
    `moonserve.pipeline.speculative.endpoint`), asked without waiting: steps draft nothing until
    the answer is there and the connection's handshake is done. A lost or refused connection marks
    that address stale, so the resolver asks Serve again.
    """

    def __init__(self, resolver_path: str, deadline_s: float, stats: ProposerStats,
                 shard: int = 0, refresh_s: float | None = None):
        self.resolver_path = resolver_path
        self.shard = shard
        # Sharded: ask the resolver again this often, and follow the shard if it moved.
        self.refresh_s = refresh_s
        self.next_refresh = 0.0
        self.deadline_s = deadline_s
        self.stats = stats
        self.context = zmq.Context(io_threads=1)  # no thread until the first socket (TP rank 0)
        self.encoder = msgspec.msgpack.Encoder()
        self.reply_decoder = msgspec.msgpack.Decoder(StepReply)
        self.answer_decoder = msgspec.msgpack.Decoder(EndpointAnswer)
        self.resolver: zmq.Socket | None = None
        self.resolving = False  # a query to the resolver is unanswered
        self.next_attempt = 0.0  # no resolver query before this
        self.endpoint: EndpointAnswer | None = None
        self.stale: str | None = None
        self.sock: zmq.Socket | None = None  # DEALER to the step server
        self.monitor: zmq.Socket | None = None  # its connection events
        self.poller: zmq.Poller | None = None
        self.connected = False  # the handshake succeeded: steps can be sent
        self.seq = 0
        self.pending: int | None = None  # seq of a call whose reply has not come yet
        self.sent_at = 0.0  # when the pending call went out

    def call(self, request: StepRequest) -> StepReply | None:
        """Send `request` and wait for its reply; None when no reply within the deadline."""
        if not self.send(request):
            return None
        return self.receive()

    def send(self, request: StepRequest) -> bool:
        """Send `request` unless no step can go now (counted as skipped); False: not sent."""
        if not self._ready():
            self.stats.skipped += 1
            return False
        self.seq += 1
        request.seq = self.seq
        request.stats = self.stats.take()  # counted since the last message that went out
        self.sent_at = time.monotonic()
        try:
            self._send(request)
        except ConnectionError as e:
            self._lost(e)
            return False
        self.pending = self.seq
        return True

    def receive(self) -> StepReply | None:
        """The reply of the call `send` made, waiting at most until its deadline; None when none
        came by then."""
        try:
            reply = self._wait(self.sent_at + self.deadline_s - time.monotonic())
        except ConnectionError as e:
            self._lost(e)
            return None
        self.stats.calls += 1
        if reply is None:
            self.stats.missed += 1
            return None
        self.stats.rtt_s.append(time.monotonic() - self.sent_at)
        return reply

    def _lost(self, e: ConnectionError) -> None:
        logger.warning("draft service connection lost (%s); drafting nothing meanwhile", e)
        self._drop_service()

    def close(self) -> None:
        self.context.destroy(linger=0)  # closes every socket of this client

    def _ready(self) -> bool:
        if self.sock is None:
            if self.endpoint is None:
                self.endpoint = self._poll_resolver()
            if self.endpoint is None:
                return False
            self._connect_service()
        elif self.refresh_s is not None and self.pending is None and \
                time.monotonic() >= self.next_refresh:
            self._refresh()
        try:
            if not self.connected:
                self._check_monitor()
            elif self.pending is not None:
                self._wait(0.0)  # the late reply of a missed call: read and drop it
        except ConnectionError as e:
            logger.warning("draft service connection lost (%s); drafting nothing meanwhile", e)
            self._drop_service()
            return False
        return self.connected and self.pending is None

    def _send(self, request: StepRequest) -> None:
        try:
            self.sock.send(self.encoder.encode(request), zmq.NOBLOCK)
        except zmq.Again as e:  # `immediate`: the connection went since the last step
            raise ConnectionError("disconnected") from e

    def _wait(self, timeout_s: float) -> StepReply | None:
        """The pending call's reply, or None when none comes within `timeout_s`; older (late)
        replies are dropped. Raises ConnectionError when the connection is lost."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = math.ceil(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(self.poller.poll(left_ms))
            if self.monitor in ready:
                self._check_monitor()
            if self.sock not in ready:
                if time.monotonic() >= deadline:
                    return None
                continue
            try:
                reply = self.reply_decoder.decode(self.sock.recv())
            except msgspec.DecodeError as e:
                raise ConnectionError(f"unreadable draft reply: {e}") from e
            if reply.deadline_ms:  # the service's say, late replies included
                self.deadline_s = reply.deadline_ms / 1000.0
            if reply.seq == self.pending:
                self.pending = None
                return reply

    def _check_monitor(self) -> None:
        """Apply the step connection's events; raises ConnectionError when it is lost."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                raise ConnectionError(zmq.Event(event).name.lower())
            self.connected = True

    def _poll_resolver(self) -> EndpointAnswer | None:
        """The resolver's answer to this client's query, asked without waiting: None until an
        answer naming a step server is there."""
        if self.resolver is None:  # zmq connects (and reconnects) in the background
            self.resolver = self.context.socket(zmq.DEALER)
            self.resolver.linger = 0
            self.resolver.connect(f"ipc://{self.resolver_path}")
        now = time.monotonic()
        if not self.resolving:
            if now < self.next_attempt:
                return None
            query = EndpointQuery(self.stale, self.shard)
            try:
                self.resolver.send(self.encoder.encode(query), zmq.NOBLOCK)
            except zmq.Again:  # not queued (the resolver socket is not set up yet): next step
                return None
            self.resolving = True
        try:
            answer = self.answer_decoder.decode(self.resolver.recv(zmq.NOBLOCK))
        except zmq.Again:  # no answer yet
            return None
        except msgspec.DecodeError as e:
            answer = EndpointAnswer(error=f"unreadable resolver answer: {e}")
        self.resolving = False
        if answer.endpoint and answer.token:
            return answer
        self.next_attempt = now + RECONNECT_INTERVAL_S  # the service is down: ask again later
        return None

    def _refresh(self) -> None:
        """Sharded: where the shard lives now; a shard back on its own replica (after a restart
        sent it elsewhere) is followed there, its sessions rebuilt from resent contexts."""
        answer = self._poll_resolver()
        if answer is None:
            return
        self.next_refresh = time.monotonic() + self.refresh_s
        if answer.endpoint != self.endpoint.endpoint:
            self._close_service()
            self.endpoint = answer
            self._connect_service()

    def _connect_service(self) -> None:
        self.sock, self.monitor = connect_step_socket(self.context, self.endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connected, self.pending = False, None
        self.next_refresh = time.monotonic() + (self.refresh_s or 0.0)

    def _close_service(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.monitor.close(linger=0)
        self.sock = self.monitor = self.poller = self.pending = None
        self.connected = False

    def _drop_service(self) -> None:
        self._close_service()
        if self.endpoint is not None:
            self.stale = self.endpoint.endpoint
        self.endpoint = None
        self.next_attempt = time.monotonic() + RECONNECT_INTERVAL_S


class ShardedDraftClient:
    """A DraftService of several replicas: one `DraftClient` per shard. Each step's rows go to
    the shards their request ids hash to (`shard_of`), one message per shard, all sent before any
    reply is awaited, each reply awaited until its own call's deadline at most; a shard that
    cannot take the step or misses it costs its own rows' drafts only."""

    def __init__(self, resolver_path: str, deadline_s: float, stats: ProposerStats,
                 shards: int, refresh_s: float = REFRESH_S):
        self.clients = [DraftClient(resolver_path, deadline_s, stats, shard=i, refresh_s=refresh_s)
                        for i in range(shards)]

    def call(self, request: StepRequest) -> StepReply | None:
        """One step: the shards' replies merged in row order; a row whose shard did not answer
        gets no drafts and is resent from its position. None when no shard answered."""
        n = len(self.clients)
        rows_of: dict[int, list[int]] = {}
        for i, row in enumerate(request.rows):
            rows_of.setdefault(shard_of(row.request_id, n), []).append(i)
        released: dict[int, list[str]] = {}
        for request_id in request.release:
            released.setdefault(shard_of(request_id, n), []).append(request_id)
        sent = [shard for shard in sorted(rows_of.keys() | released.keys())
                if self.clients[shard].send(StepRequest(
                    k=request.k, rows=[request.rows[i] for i in rows_of.get(shard, ())],
                    release=released.get(shard, [])))]
        replies = {shard: self.clients[shard].receive() for shard in sent}
        answered = {shard: r for shard, r in replies.items() if r is not None and not r.error}
        if not answered:
            return None
        drafts: list[list[int]] = [[] for _ in request.rows]
        resend_from = [row.position for row in request.rows]
        quiet = [0] * len(request.rows)
        for shard, reply in answered.items():
            for j, i in enumerate(rows_of.get(shard, ())):
                drafts[i], resend_from[i] = reply.drafts[j], reply.resend_from[j]
                quiet[i] = reply.quiet[j] if reply.quiet else 0
        return StepReply(seq=0, drafts=drafts, resend_from=resend_from, quiet=quiet)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def decoder_layers(model) -> list:
    """The target's decoder layers (`model.model.layers` of its language model)."""
    language_model = model.get_language_model() if hasattr(model, "get_language_model") \
        else model
    return list(language_model.model.layers)


def check_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{ENV_HIDDEN_LAYERS}: layers {bad} are not among the target's "
                         f"{num_layers} decoder layers")


class HiddenCapture:
    """The target's hidden states at `layer_ids` for every token of the engine's last forward pass.

    Each is the residual stream after that decoder layer, `hidden_states + residual` of the
    layer's output, which is what vLLM's DSpark reads as aux hidden states (`target_layer_ids`
    i -> aux layer i + 1). Forward hooks keep them, so the engine must run eagerly: a compiled
    graph skips the hooks.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        layers = decoder_layers(model)
        check_layer_ids(layer_ids, len(layers))
        self.layer_ids = tuple(layer_ids)
        self.states: list = [None] * len(layer_ids)
        for slot, index in enumerate(layer_ids):
            layers[index].register_forward_hook(functools.partial(self._keep, slot))

    def _keep(self, slot: int, module, args, output) -> None:
        hidden, residual = output[0], output[-1]  # vLLM's decoder layers: (mlp out, residual)
        self.states[slot] = hidden if residual is None else hidden + residual

    def rows(self, start: int, end: int):
        """Rows `start .. end - 1` of the last pass, `[end - start, len(layer_ids) * hidden]`."""
        import torch

        return torch.cat([state[start:end] for state in self.states], dim=-1)


@dataclass
class UnsentHidden:
    """A request's hidden states the service has not confirmed: context positions
    `start .. start + rows - 1`."""

    start: int
    parts: list = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + sum(int(p.shape[0]) for p in self.parts)

    def add(self, start: int, rows) -> None:
        """Rows from context position `start`; rows from there on are replaced (a rerun)."""
        if not self.start <= start <= self.end:  # not contiguous: start over from here
            self.start, self.parts = start, [rows]
        elif start == self.end:
            self.parts.append(rows)
        else:
            self.parts = [self.concat()[: start - self.start], rows]

    def concat(self):
        import torch

        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]


class HiddenStates:
    """Per request, the target's hidden states the DraftService has not confirmed yet.

    After each forward pass, `collect` keeps the rows the target has accepted: per request, the
    rows at positions below its newest token (that one, just sampled, is the draft's anchor). A
    prefill chunk that samples nothing is kept too and goes with the request's first row. A row
    carries everything unconfirmed; a reply without `resend_from` confirms it. Confirmed states
    are dropped, so when the service later asks for older context (it restarted or evicted the
    session), the request drafts nothing from then on (`given_up`).
    """

    def __init__(self):
        self.unsent: dict[str, UnsentHidden] = {}
        self.given_up: set[str] = set()
        self.dtype = "float32"

    def collect(self, req_ids, num_tokens_no_spec, query_start, positions, rows) -> None:
        """Keep what the engine's last pass accepted. Its layout: `query_start` (host) and
        `positions` (device) of its tokens, batch row by batch row; `rows(start, end)`: the hidden
        states of its tokens `start .. end - 1`; `num_tokens_no_spec`: each row's tokens now."""
        positions = positions[: int(query_start[len(req_ids)])].to("cpu")
        for i, request_id in enumerate(req_ids):
            start, end = int(query_start[i]), int(query_start[i + 1])
            if start == end or request_id in self.given_up:
                continue
            first = int(positions[start])
            count = min(end - start, int(num_tokens_no_spec[i]) - 1 - first)
            if count > 0:
                kept = rows(start, start + count).to("cpu")
                self.unsent.setdefault(request_id, UnsentHidden(first)).add(first, kept)

    def attach(self, row: Row) -> None:
        unsent = self.unsent.get(row.request_id)
        if unsent is not None and unsent.parts:
            self.dtype, row.hidden = hidden_payload(unsent.concat())
            row.hidden_start = unsent.start

    def confirmed(self, request_id: str) -> None:
        self.unsent.pop(request_id, None)

    def can_resend(self, request_id: str, position: int) -> bool:
        """Whether the context the service asks for (tokens from `position`, so hidden states
        from `position - 1`) is still here; if not, the request is given up."""
        unsent = self.unsent.get(request_id)
        if unsent is not None and unsent.start <= max(position - 1, 0):
            return True
        self.unsent.pop(request_id, None)
        self.given_up.add(request_id)
        return False

    def keep_only(self, live: set[str]) -> None:
        """Forget the requests that left the batch (a prefill may end without a row sent)."""
        for request_id in [r for r in self.unsent if r not in live]:
            del self.unsent[request_id]
        self.given_up &= live


def hidden_payload(rows) -> tuple[str, bytes]:
    """(dtype name, raw row-major bytes) of a hidden-state tensor for the wire."""
    import torch

    rows = rows.detach().to("cpu").contiguous()
    dtype = str(rows.dtype).removeprefix("torch.")
    if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits as int16
        return dtype, rows.view(torch.int16).numpy().tobytes()
    return dtype, rows.numpy().tobytes()


def hidden_layers() -> tuple[int, ...]:
    """The target's layers whose hidden states go with each row
    (`MOONSERVE_DRAFT_HIDDEN_LAYERS`)."""
    return tuple(int(i) for i in os.environ.get(ENV_HIDDEN_LAYERS, "").split(",") if i.strip())


def draft_client(stats: ProposerStats) -> DraftClient | ShardedDraftClient:
    """The connection to the DraftService the LanguageModel replica set up for this engine (its
    resolver's socket, the deadline, the shards: the `MOONSERVE_DRAFT_*` variables)."""
    path = os.environ.get(ENV_SOCKET)
    if not path:
        raise RuntimeError(f"{ENV_SOCKET} is not set: the LanguageModel deployment sets it to "
                           "its draft endpoint resolver's socket before starting the engine")
    deadline_s = float(os.environ.get(ENV_DEADLINE_MS, DEFAULT_DEADLINE_MS)) / 1000.0
    shards = int(os.environ.get(ENV_SHARDS, "1"))
    return DraftClient(path, deadline_s, stats) if shards == 1 else \
        ShardedDraftClient(path, deadline_s, stats, shards)


@dataclass
class StepPlan:
    """One step's message, and for each of its rows the batch row it answers and the drafts that
    fit before `max_model_len`."""

    request: StepRequest
    slots: list[int]
    room: list[int]


class DraftBook:
    """What the DraftService holds of each request, as far as the engine knows, and each step's
    message built from it. Both model runners' speculators keep one: `ServiceProposer` (V1) and
    `ServiceSpeculator` (V2, `speculator_v2.py`).

    A row sends only the tokens the service does not hold yet; a request in the service's
    adaptive pause (`StepReply.quiet`) is left out of that many steps, its tokens waiting for its
    next row; requests that left the batch are released in the next message. A reply that asks to
    `resend_from` a position gets those tokens again in the request's next row; a lost reply,
    every token of its message.
    """

    def __init__(self, k: int, max_model_len: int, stats: ProposerStats,
                 hidden: HiddenStates | None = None):
        self.k, self.max_model_len, self.stats, self.hidden = k, max_model_len, stats, hidden
        # request id -> context tokens the service holds (as far as we know)
        self.sent: dict[str, int] = {}
        # request id -> steps left out of the calls (the service's adaptive pause for it)
        self.quiet: dict[str, int] = {}

    def plan(self, req_ids, candidates, tokens, min_acceptance: float | None) -> StepPlan | None:
        """This step's message. `candidates`: (batch row, tokens its request has) of the rows
        that sampled a token and may draft; `tokens(row, start, end)`: that row's token ids in
        [start, end). None when there is nothing to send."""
        hidden = self.hidden
        rows, slots, room = [], [], []
        for i, num_tokens in candidates:
            request_id = req_ids[i]
            if num_tokens >= self.max_model_len or \
                    (hidden is not None and request_id in hidden.given_up):
                continue
            if self.quiet.get(request_id, 0) > 0:  # its tokens wait for the next row it sends
                self.quiet[request_id] -= 1
                self.stats.quiet += 1
                continue
            position = min(self.sent.get(request_id, 0), num_tokens)
            row = Row(request_id, position, tokens(i, position, num_tokens))
            if hidden is not None:
                hidden.attach(row)
            rows.append(row)
            slots.append(i)
            room.append(min(self.k, self.max_model_len - num_tokens))
            self.sent[request_id] = num_tokens
        live = set(req_ids)
        release = [r for r in self.sent if r not in live]
        for request_id in release:
            del self.sent[request_id]
            self.quiet.pop(request_id, None)
        if hidden is not None:
            hidden.keep_only(live)
        if not rows and not release:
            return None
        return StepPlan(StepRequest(k=self.k, rows=rows, release=release,
                                    hidden_dtype=hidden.dtype if hidden else "bfloat16",
                                    min_acceptance=min_acceptance), slots, room)

    def answers(self, plan: StepPlan, reply: StepReply | None) -> dict[int, list[int]] | None:
        """Batch row -> its drafts, from the service's `reply` to `plan`'s message. None when
        there is no usable reply: not known whether the service applied the message's tokens,
        so they are sent again next time."""
        rows = plan.request.rows
        if reply is None or reply.error:
            for row in rows:
                self.sent[row.request_id] = row.position
            return None
        hidden = self.hidden
        drafts: dict[int, list[int]] = {}
        quiet = reply.quiet or [0] * len(rows)  # a service that pauses nothing sends none
        for slot, limit, row, row_drafts, resend, steps in zip(
                plan.slots, plan.room, rows, reply.drafts, reply.resend_from, quiet, strict=True):
            if steps > 0:
                self.quiet[row.request_id] = steps
            if resend < 0:
                drafts[slot] = row_drafts[:limit]
                if hidden is not None:
                    hidden.confirmed(row.request_id)
            elif hidden is None or hidden.can_resend(row.request_id, resend):
                self.sent[row.request_id] = resend
            else:  # its context cannot be rebuilt: no more drafts; released when it leaves
                self.sent[row.request_id] = 0
        return drafts


def seeded_sampling(batch, row: int) -> bool:
    """A sampled request with a `seed`: it gets no drafts. Verification draws its random numbers
    per draft token, so whether a draft arrived before the deadline would change the answer a
    seed must repeat (with no drafts it is the same every time)."""
    return row in batch.generators and batch.req_ids[row] in batch.random_reqs


def plain_sampling_without_drafts(runner) -> None:
    """Make `runner` (vLLM's V1 model runner) sample a step in which no request has draft tokens
    with its plain sampler, as if no speculator were configured.

    vLLM builds spec-decode metadata and runs `RejectionSampler` on every step once a speculator
    is configured (gpu_model_runner.py `_sample`: the rejection sampler whenever
    `spec_decode_metadata` is set, and it is set for every step). With no draft in the batch its
    output is the plain sampler's, one token per request (the "bonus" token), but it costs a pass
    over the logits and, for sampled requests, noise over the whole vocabulary per request. The
    output shape is the same [batch, 1] either way, so vLLM's bookkeeping takes the same branch.
    A batch holding a seeded request (`input_batch.generators`) keeps vLLM's path: the two
    samplers draw from its generator differently, and whether a step has drafts depends on the
    other requests' timing, so switching would make a seed's answer vary between runs.
    """
    sample = runner._sample

    def sample_plain_without_drafts(logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0 \
                and not runner.input_batch.generators:
            spec_decode_metadata = None
        return sample(logits, spec_decode_metadata)

    runner._sample = sample_plain_without_drafts


def find_model_runner(frame):
    """The vLLM model runner constructing us: the first caller frame whose `self` is one."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, GPUModelRunner):
            return candidate
        frame = frame.f_back
    raise RuntimeError("ServiceProposer must be constructed by vLLM's model runner "
                       "(speculative_config method 'custom_class'); none found on the stack")


class ServiceProposer:
    """vLLM `custom_class` proposer; see the module docstring."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.enforce_eager = vllm_config.model_config.enforce_eager
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.runner = find_model_runner(sys._getframe(1))
        plain_sampling_without_drafts(self.runner)
        self.stats = ProposerStats()
        self.client = draft_client(self.stats)
        self.book = DraftBook(self.k, self.max_model_len, self.stats)
        self.hidden_layers = hidden_layers()
        self.capture: HiddenCapture | None = None
        self.cost = StepCost()
        self.clock = time.perf_counter
        self.last_step: tuple[float, dict[str, int]] | None = None  # time, drafts per request

    def load_model(self, model=None, *args, **kwargs) -> None:
        """The drafter lives in the DraftService (vLLM requires the call). With
        `MOONSERVE_DRAFT_HIDDEN_LAYERS`, hooks on the target `model` keep its hidden states."""
        if self.hidden_layers:
            if not self.enforce_eager:
                raise ValueError("draft.drafter dspark_context on vLLM's model runner V1 (the CPU "
                                 "build) needs language_model.engine.enforce_eager: true (the "
                                 "proposer reads the target's hidden states with forward hooks, "
                                 "which a compiled graph skips)")
            self.capture = HiddenCapture(model, self.hidden_layers)
            self.book.hidden = HiddenStates()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        if self.tp_size == 1:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) \
            if group.rank_in_group == 0 else None
        return group.broadcast_object(drafts, src=0)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        if self.book.hidden is not None:
            self.book.hidden.collect(req_ids, num_tokens_no_spec, self.runner.query_start_loc.np,
                                     self.runner.positions, self.capture.rows)
        self._observe_step(req_ids, sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        candidates = [(i, int(num_tokens_no_spec[i])) for i, sampled in enumerate(sampled_token_ids)
                      if sampled and not seeded_sampling(batch, i)]
        plan = self.book.plan(req_ids, candidates,
                              lambda i, start, end: token_ids_cpu[i, start:end].tolist(),
                              self.cost.min_acceptance())
        if plan is None:
            return self._drafted(req_ids, drafts)
        answers = self.book.answers(plan, self.client.call(plan.request))
        if answers is None:
            return drafts
        for slot, row_drafts in answers.items():
            drafts[slot] = row_drafts
        return self._drafted(req_ids, drafts)

    def _observe_step(self, req_ids, sampled_token_ids) -> None:
        """The step that just ran, for the step-cost model (`StepCost`): when every request of
        it was in the previous step too (a decode step: no prefill in it), the tokens it verified
        (each request's drafts from the last call, plus one), the tokens it kept, and the time
        since the last call (one engine loop)."""
        now = self.clock()
        if self.last_step is not None and sampled_token_ids and all(sampled_token_ids):
            began, drafted = self.last_step
            if all(r in drafted for r in req_ids):
                self.cost.observe(sum(1 + drafted[r] for r in req_ids),
                                  sum(len(t) for t in sampled_token_ids), now - began)
        self.last_step = (now, {})

    def _drafted(self, req_ids, drafts: list[list[int]]) -> list[list[int]]:
        """Remember how many drafts each request gets this step (verified in the next one)."""
        self.last_step[1].update(zip(req_ids, map(len, drafts)))
        return drafts
