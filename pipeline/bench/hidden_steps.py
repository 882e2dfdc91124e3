"""Draft steps that carry the target's hidden states: bytes per step and round trip per batch size.

The `hidden_state_steps` section of `moonserve bench speculative`. It uses a real `StepServer`
(ZeroMQ, PLAIN auth, the service's one thread) with a `DraftCore` over a `ContextDSparkDrafter`.
The drafter has random weights in K3 DSpark's geometry at the GPU smoke run's size
(`SMOKE_DIMS`: hidden 1024, MLA latent 512 + rope 64, 16 heads, 2 layers, 3 target layers). The
client sends from a proposer's socket (`connect_step_socket`). Per batch size:

- a prefill step: every request's prompt (`PROMPT_TOKENS`) with its hidden states;
- `steps` decode steps: each row brings one accepted draft and the new bonus token, with the hidden
  states of the two positions the target ran (the previous anchor and the accepted draft). That
  is the steady state at one accepted draft per step.

Reported per batch: request bytes per decode step and per row, round trip p50/p99 (send to
reply), and the service's own step time p50 (the drafter's one pass included).
`per_request_passes` repeats it with the same model drafting one request per forward pass, as the
DraftService drafted before batching: what the one pass per step buys. `bytes_per_step_k3`
encodes the same decode step at K3's production widths (`K3_TARGET_HIDDEN` x `K3_TARGET_LAYERS`,
bfloat16) without drafting: what the wire carries on a GPU node.
"""

from __future__ import annotations

import statistics
import time

import msgspec
import torch
import zmq

from moonserve.pipeline.bench.client import percentile
from moonserve.pipeline.models.dspark import DSparkConfig, DSparkModel
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.dspark_context import ContextDSparkDrafter
from moonserve.pipeline.speculative.endpoint import StepServer, connect_step_socket
from moonserve.pipeline.speculative.service import DraftCore
from moonserve.pipeline.speculative.wire import EndpointAnswer, Row, StepReply, StepRequest
from moonserve.pipeline.synthetic_checkpoints.k3_random_weights import SMOKE_DIMS

BATCHES = (1, 8, 64)
PROMPT_TOKENS = 64
NEW_TOKENS = 2  # per decode row: one accepted draft + the bonus token
TARGET_LAYERS = 3
K3_TARGET_HIDDEN = 7168  # Kimi K3's hidden size
K3_TARGET_LAYERS = 3  # target_layer_ids of the published DSpark drafts: first, middle, last
DTYPE = torch.bfloat16


def smoke_drafter(seed: int = 0) -> ContextDSparkDrafter:
    d = SMOKE_DIMS
    config = DSparkConfig(
        hidden_size=d.hidden_size, vocab_size=d.vocab_size, num_hidden_layers=2,
        num_attention_heads=d.num_attention_heads, intermediate_size=d.intermediate_size,
        q_lora_rank=d.q_lora_rank, kv_lora_rank=d.kv_lora_rank,
        qk_nope_head_dim=d.qk_nope_head_dim, qk_rope_head_dim=d.qk_rope_head_dim,
        v_head_dim=d.v_head_dim, markov_rank=32, mask_token_id=1,
        target_hidden_size=d.hidden_size, num_target_layers=TARGET_LAYERS,
        max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = DSparkModel(config, tie_word_embeddings=False, conditioned=True)
    for name, p in model.named_parameters():
        p.data = torch.ones_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p)
    return ContextDSparkDrafter(model)


class StepClient:
    """A proposer's socket to a step server: one call at a time, timed."""

    def __init__(self, server: StepServer):
        self.context = zmq.Context()
        endpoint = server.endpoint()
        self.sock, self.monitor = connect_step_socket(
            self.context, EndpointAnswer(endpoint["endpoint"], endpoint["token"]))
        self.monitor.recv_multipart()  # the handshake succeeded
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepReply)
        self.seq = 0

    def call(self, request: StepRequest) -> tuple[StepReply, int, float]:
        """(reply, request bytes, round trip seconds)."""
        self.seq += 1
        request.seq = self.seq
        payload = self.encoder.encode(request)
        start = time.perf_counter()
        self.sock.send(payload)
        reply = self.decoder.decode(self.sock.recv())
        return reply, len(payload), time.perf_counter() - start

    def close(self) -> None:
        self.sock.close(linger=0)
        self.monitor.close(linger=0)
        self.context.term()


def hidden_bytes(num_tokens: int, width: int, generator: torch.Generator) -> bytes:
    return (torch.randn(num_tokens, width, generator=generator).to(DTYPE)
            .view(torch.int16).numpy().tobytes())


class PerRequestDrafter(ContextDSparkDrafter):
    """The same drafter, drafting one request per forward pass (the comparison arm)."""

    batched = False


def run_batch(drafter: ContextDSparkDrafter, batch: int, steps: int, k: int) -> dict:
    width = drafter.config.context_width
    core = DraftCore({"dspark_context": lambda: drafter}, "dspark_context",
                     adaptive=AdaptivePolicy(enabled=False))
    seconds: list[float] = []

    def handler(message: dict):
        reply, observation = core.step(message)
        seconds.append(observation.seconds)
        return reply, None

    server = StepServer(handler, host="127.0.0.1")
    server.start()
    client = StepClient(server)
    g = torch.Generator().manual_seed(batch)
    try:
        tokens = {f"r{i}": torch.randint(2, drafter.config.vocab_size, (PROMPT_TOKENS + 1,),
                                         generator=g).tolist() for i in range(batch)}
        rows = [Row(rid, 0, ids, 0, hidden_bytes(PROMPT_TOKENS, width, g))
                for rid, ids in tokens.items()]
        reply, prefill_bytes, _ = client.call(StepRequest(k=k, rows=rows, hidden_dtype="bfloat16"))
        drafts = dict(zip(tokens, reply.drafts, strict=True))
        sizes, rtts = [], []
        for _ in range(steps):
            rows = []
            for rid, ids in tokens.items():
                held = len(ids)
                ids.extend([drafts[rid][0] if drafts[rid] else 2, int(torch.randint(
                    2, drafter.config.vocab_size, (1,), generator=g))])
                rows.append(Row(rid, held, ids[held:], held - 1,
                                hidden_bytes(NEW_TOKENS, width, g)))
            reply, size, rtt = client.call(StepRequest(k=k, rows=rows, hidden_dtype="bfloat16"))
            if reply.error or any(r >= 0 for r in reply.resend_from):
                raise RuntimeError(f"step failed: {reply.error or reply.resend_from}")
            drafts = dict(zip(tokens, reply.drafts, strict=True))
            sizes.append(size)
            rtts.append(rtt)
    finally:
        client.close()
        server.close()
    decode_seconds = seconds[1:]
    return {"batch": batch, "steps": steps, "prefill_bytes": prefill_bytes,
            "bytes_per_step": statistics.mean(sizes),
            "bytes_per_row": statistics.mean(sizes) / batch,
            "round_trip_ms_p50": 1000 * percentile(rtts, 0.5),
            "round_trip_ms_p99": 1000 * percentile(rtts, 0.99),
            "service_step_ms_p50": 1000 * percentile(decode_seconds, 0.5),
            "bytes_per_step_k3": k3_step_bytes(batch, k)}


def k3_step_bytes(batch: int, k: int) -> int:
    """A decode step's request bytes at K3's widths (encoded, not sent)."""
    g = torch.Generator().manual_seed(0)
    width = K3_TARGET_HIDDEN * K3_TARGET_LAYERS
    rows = [Row(f"r{i}", 1000, [5, 6], 999, hidden_bytes(NEW_TOKENS, width, g))
            for i in range(batch)]
    return len(msgspec.msgpack.encode(StepRequest(seq=1, k=k, rows=rows)))


def measure(steps: int, k: int, batches: tuple[int, ...] = BATCHES) -> dict:
    """The bench section: per batch size, see the module doc."""
    torch.set_num_threads(1)  # as the DraftService runs it
    drafter = smoke_drafter()
    per_request = PerRequestDrafter(drafter.model)
    c = drafter.config
    return {"drafter": {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
                        "kv_lora_rank": c.kv_lora_rank, "context_width": c.context_width,
                        "weights": "random", "dtype": "float32"},
            "hidden_dtype": "bfloat16", "new_tokens_per_row": NEW_TOKENS,
            "prompt_tokens": PROMPT_TOKENS, "k": k,
            "k3_context_width": K3_TARGET_HIDDEN * K3_TARGET_LAYERS,
            "batches": [run_batch(drafter, b, steps, k) for b in batches],
            "per_request_passes": [run_batch(per_request, b, steps, k) for b in batches]}
