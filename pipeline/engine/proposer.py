"""`ServiceProposer`: vLLM's `custom_class` proposer that takes its drafts from the DraftService.

vLLM (0.32, V1 model runner) constructs it in each worker with `vllm_config`, calls `load_model`
once, then `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`
synchronously every engine step; the returned lists (one per batch row) are the draft tokens its
rejection sampler verifies in the next step, so the output is the target's whatever they are.

Per step the proposer sends ONE message for the whole batch over a TCP connection straight to the
DraftService replica, whose address it gets from the resolver in the LM replica (a Unix socket
named by `MOONSERVE_DRAFT_SOCKET`; `moonserve.pipeline.speculative.endpoint`); `moonserve.pipeline.speculative.wire`
has the message format:

- Rows are mapped to request ids through the model runner's input batch (the runner is the frame
  that constructs this class), so the service keeps one context per request; each row sends only
  the tokens added since the proposer's last call for that request.
- Rows with nothing sampled this step (a prefill chunk) or at `max_model_len` get no drafts, as in
  vLLM's own ngram proposer. Requests that left the batch are released on the next message.
- Deadline: the reply must come within `MOONSERVE_DRAFT_DEADLINE_MS` (or the deadline the service
  last sent, see `DraftService.set_deadline`), else the step drafts nothing.
  At most one call is in flight: while a late reply is outstanding (or the service is unreachable,
  or its address is being resolved), steps draft nothing WITHOUT waiting, so a dead DraftService
  costs decode one deadline, not one per step. The late reply is read and dropped when it comes;
  speculation resumes on the next step.
- Tensor parallelism: rank 0 calls and broadcasts its drafts over the TP group's CPU group, so every
  rank returns identical drafts.

Example (what vLLM does with it):
    >>> LLM(model, speculative_config={"method": "custom_class", "num_speculative_tokens": 4,
    ...     "model": "moonserve.pipeline.engine.proposer.ServiceProposer"})
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field

from moonserve.pipeline.speculative.wire import FrameReader, send_frame

ENV_SOCKET = "MOONSERVE_DRAFT_SOCKET"
ENV_DEADLINE_MS = "MOONSERVE_DRAFT_DEADLINE_MS"
DEFAULT_DEADLINE_MS = 25.0
# After a failed connect, try again this much later (steps in between draft nothing).
RECONNECT_INTERVAL_S = 1.0

logger = logging.getLogger("moonserve.proposer")


@dataclass
class ProposerStats:
    """Counted since the last message; sent with it (the DraftService exports them as metrics)."""

    calls: int = 0
    skipped: int = 0  # no call: the previous one is still pending, or no connection yet
    missed: int = 0  # the reply missed the deadline
    rtt_s: list[float] = field(default_factory=list)

    def take(self) -> dict:
        out = {"calls": self.calls, "skipped": self.skipped, "missed": self.missed,
               "rtt_s": self.rtt_s}
        self.calls = self.skipped = self.missed = 0
        self.rtt_s = []
        return out


class DraftClient:
    """The proposer's connection to the DraftService; at most one call in flight, never waiting
    longer than the deadline.

    The DraftService's address comes from the LM replica's resolver (a Unix socket, see
    `moonserve.pipeline.speculative.endpoint`), asked without waiting: steps draft nothing until the answer
    is there. A failed connection marks that address stale, so the resolver asks Serve again.
    """

    def __init__(self, resolver_path: str, deadline_s: float, stats: ProposerStats):
        self.resolver_path = resolver_path
        self.deadline_s = deadline_s
        self.stats = stats
        self.resolver: socket.socket | None = None
        self.resolver_reader: FrameReader | None = None
        self.resolving = False  # a query to the resolver is unanswered
        self.next_attempt = 0.0  # no resolver connect / query / service connect before this
        self.endpoint: dict | None = None
        self.stale: str | None = None
        self.sock: socket.socket | None = None
        self.reader: FrameReader | None = None
        self.seq = 0
        self.pending: int | None = None  # seq of a call whose reply has not come yet

    def call(self, message: dict) -> dict | None:
        """Send `message` and wait for its reply; None when no reply within the deadline."""
        if not self._ready():
            self.stats.skipped += 1
            return None
        self.seq += 1
        message["seq"] = self.seq
        message["stats"] = self.stats.take()  # counted since the last message that went out
        start = time.monotonic()
        try:
            send_frame(self.sock, message)
            self.pending = self.seq
            reply = self._wait(self.deadline_s)
        except OSError as e:  # ConnectionError included
            logger.warning("draft service connection lost (%s); drafting nothing meanwhile", e)
            self._drop_service()
            return None
        self.stats.calls += 1
        if reply is None:
            self.stats.missed += 1
            return None
        self.stats.rtt_s.append(time.monotonic() - start)
        return reply

    def _ready(self) -> bool:
        if self.sock is None:
            if self.endpoint is None:
                self._poll_resolver()
            if self.endpoint is not None:
                self._connect_service()
            return False if self.sock is None else self.pending is None
        if self.pending is not None:
            try:
                self._wait(0.0)  # the late reply of a missed call: read and drop it
            except OSError:
                self._drop_service()
                return False
        return self.pending is None

    def _wait(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while True:
            frame = self.reader.read(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            if frame.get("deadline_ms"):  # the service's say, late replies included
                self.deadline_s = float(frame["deadline_ms"]) / 1000.0
            if frame.get("seq") == self.pending:
                self.pending = None
                return frame
            # an older late reply: drop it

    def _poll_resolver(self) -> None:
        now = time.monotonic()
        try:
            if self.resolver is None:
                if now < self.next_attempt:
                    return
                self.next_attempt = now + RECONNECT_INTERVAL_S
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(self.resolver_path)
                except OSError:
                    sock.close()
                    return
                self.resolver, self.resolver_reader, self.resolving = sock, FrameReader(sock), False
            if not self.resolving and now >= self.next_attempt:
                send_frame(self.resolver, {"op": "endpoint", "stale": self.stale})
                self.resolving = True
            answer = self.resolver_reader.read(0.0) if self.resolving else None
        except OSError:
            if self.resolver is not None:
                self.resolver.close()
            self.resolver = self.resolver_reader = None
            return
        if answer is not None:
            self.resolving = False
            if "endpoint" in answer:
                self.endpoint = answer
            else:  # the service is down: ask again a little later
                self.next_attempt = now + RECONNECT_INTERVAL_S

    def _connect_service(self) -> None:
        host, port = self.endpoint["endpoint"].rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.deadline_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(sock, {"token": self.endpoint["token"]})
        except OSError:
            self._drop_service()
            return
        self.sock, self.reader, self.pending = sock, FrameReader(sock), None

    def _drop_service(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.endpoint is not None:
            self.stale = self.endpoint["endpoint"]
        self.sock = self.reader = self.pending = self.endpoint = None
        self.next_attempt = time.monotonic() + RECONNECT_INTERVAL_S


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
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.runner = find_model_runner(sys._getframe(1))
        self.stats = ProposerStats()
        path = os.environ.get(ENV_SOCKET)
        if not path:
            raise RuntimeError(f"{ENV_SOCKET} is not set: the LanguageModel deployment sets it to "
                               "its draft endpoint resolver's socket before starting the engine")
        deadline_ms = float(os.environ.get(ENV_DEADLINE_MS, DEFAULT_DEADLINE_MS))
        self.client = DraftClient(path, deadline_ms / 1000.0, self.stats)
        # request id -> context tokens the service holds (as far as we know)
        self.sent: dict[str, int] = {}

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load here: the drafter lives in the DraftService (vLLM requires the call)."""

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
        req_ids = self.runner.input_batch.req_ids
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows, slots, room = [], [], []
        for i, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[i])
            if not sampled or num_tokens >= self.max_model_len:
                continue
            request_id = req_ids[i]
            position = min(self.sent.get(request_id, 0), num_tokens)
            rows.append([request_id, position, token_ids_cpu[i, position:num_tokens].tolist()])
            slots.append(i)
            room.append(min(self.k, self.max_model_len - num_tokens))
            self.sent[request_id] = num_tokens
        live = set(req_ids)
        release = [r for r in self.sent if r not in live]
        for request_id in release:
            del self.sent[request_id]
        if not rows and not release:
            return drafts
        reply = self.client.call({"k": self.k, "rows": rows, "release": release})
        if reply is None or reply.get("error"):
            # Not known whether the service applied these tokens: resend them next time.
            for request_id, position, _ in rows:
                self.sent[request_id] = position
            return drafts
        for slot, limit, (request_id, _, _), row_drafts, resend in zip(
                slots, room, rows, reply["drafts"], reply["resend_from"], strict=True):
            if resend >= 0:
                self.sent[request_id] = resend
            else:
                drafts[slot] = list(row_drafts)[:limit]
        return drafts
