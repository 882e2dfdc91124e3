"""K3's DSpark drafting from the target's hidden states, batched across requests.

`ContextDSparkDrafter` is the DraftService's `dspark_context` drafter: what vLLM's DSpark speculator
does in the engine (`vllm/v1/worker/gpu/spec_decode/dspark/speculator.py` over
`dflash/speculator.py`, the K3 draft `vllm/models/kimi_k3/nvidia/dspark_mla.py`), done in a
separate service that receives the target's hidden states with each step. Per request:

1. Context. Each token the target has run gives its hidden states at the draft's
   `target_layer_ids` (the residual stream after each of those layers, concatenated: vLLM's aux
   hidden states). `context_norm(context_proj(states))`, then per draft layer
   `kv_a_proj_with_mqa` of that row, stored as the cache row
   `[kv_a_layernorm(latent), rope(k_pe, position)]` at the token's position
   (`precompute_and_store_context_kv`). No draft layer runs over the context.
2. Query block. `N` rows: the anchor (the token just sampled, which the target has not run) at
   its position P, then `N - 1` mask tokens at P + 1 ... P + N - 1 (`mask_token_id`, vLLM's
   parallel-drafting token). They go through the draft layers, attending to the context rows and
   to the whole block (non-causal, `non_causal_multi_token_decode`).
3. Sampling. `final_norm`, then the target's LM head: base logits `[N, vocab]`. Row i predicts
   position P + i + 1 (`sample_from_anchor`). The sequential Markov head: `prev = anchor`;
   `d_i = argmax(base[i] + markov_w2 @ markov_w1[prev])`; `prev = d_i`. This is greedy, vLLM's
   path when the draft is not sampled.

`propose_batch` runs steps 2-3 for all of a step's requests in ONE forward pass. Contexts are
padded to the longest one and masked. `add_contexts` projects all of a step's new context rows
in one pass too. The block size is the step's `k` for every request, as in vLLM. A request's
adaptive depth (`moonserve.pipeline.speculative.adaptive`) keeps a prefix of its block.

Example:
    >>> from moonserve.pipeline.models.dspark import DSparkConfig, DSparkModel
    >>> config = DSparkConfig(hidden_size=32, vocab_size=100, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=64, q_lora_rank=16, kv_lora_rank=8,
    ...     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, markov_rank=4,
    ...     mask_token_id=0, target_hidden_size=24, num_target_layers=2)
    >>> drafter = ContextDSparkDrafter(DSparkModel(config, conditioned=True))  # random weights
    >>> a, b = drafter.new_state("a"), drafter.new_state("b")
    >>> a.append([5, 6, 7]); b.append([9, 8])        # the last token of each is its anchor
    >>> drafter.add_contexts([(a, 0, torch.randn(2, 48)), (b, 0, torch.randn(1, 48))])
    >>> [len(d) for d in drafter.propose_batch([a, b], block_size=3)]   # one pass for both
    [3, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moonserve.pipeline.models.dspark import (
    DSparkConfig,
    DSparkModel,
    LayerKV,
    MLAttention,
    apply_rope,
    load_model,
    rope_cos_sin,
)
from moonserve.pipeline.models.weights import CONFIG_FILE, load_tensors
from moonserve.pipeline.speculative.dspark import TokensAndCache, block_room


class MissingContextError(ValueError):
    """Hidden states that start past the context the service holds for the request."""

    def __init__(self, start: int, num_context: int):
        self.start = start
        self.num_context = num_context
        super().__init__(f"hidden states start at position {start}, but the draft service holds "
                         f"context for positions [0, {num_context}); resend from "
                         f"{num_context}")


class ContextState(TokensAndCache):
    """One request: its token ids and its context cache rows `[0, num_context)`, per layer.

    Invariant kept by the caller (the target's proposer): context rows exist only for tokens the
    target has run, so at most `len(token_ids) - 1` (the last token is the anchor). Truncating
    the tokens drops the context rows of the dropped positions.
    """

    def __init__(self, drafter: ContextDSparkDrafter):
        super().__init__(drafter.model)
        self.drafter = drafter

    @property
    def num_context(self) -> int:
        return self.cache.num_tokens

    def propose(self, num_speculative_tokens: int) -> list[int]:
        """A batch of one (`ContextDSparkDrafter.propose_batch`)."""
        return self.drafter.propose_batch([self], num_speculative_tokens)[0]


class ContextDSparkDrafter:
    """The conditioned DSpark model, shared by every request's `ContextState`."""

    name = "dspark_context"
    batched = True  # DraftSessions calls propose_batch once per step
    prefetch = False  # tokens past the target's have no hidden states to draft from

    def __init__(self, model: DSparkModel, max_model_len: int | None = None):
        if not model.conditioned:
            raise ValueError("ContextDSparkDrafter needs DSparkModel(conditioned=True)")
        self.model = model.eval().requires_grad_(False)
        self.max_model_len = max_model_len

    @property
    def config(self) -> DSparkConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_state(self, request_id: str) -> ContextState:
        return ContextState(self)

    @classmethod
    def from_pretrained(cls, path: Path | str, dtype: torch.dtype = torch.float32,
                        max_model_len: int | None = None, shared: dict | None = None,
                        device: torch.device | str = "cpu") -> ContextDSparkDrafter:
        """A K3 DSpark checkpoint (vLLM's `K3DSparkForCausalLM` names); `shared`: the target's
        `embed_tokens.weight` and `lm_head.weight` (`target_shared_tensors`)."""
        path = Path(path)
        config = DSparkConfig.from_json(path / CONFIG_FILE)
        tensors = {**(shared or {}), **load_tensors(path)}
        model = load_model(config, tensors, source=str(path), dtype=dtype, device=device,
                           conditioned=True)
        return cls(model, max_model_len)

    @torch.inference_mode()
    def add_contexts(self, items: Sequence[tuple[ContextState, int, torch.Tensor]]) -> None:
        """Per `(state, start, states)`: the target's hidden states `[m, context_width]` of
        positions `start .. start + m - 1` become context rows (rows from `start` on are
        replaced: a duplicate or resend). One projection for all of them."""
        items = [(state, start, states) for state, start, states in items if states.shape[0]]
        for state, start, states in items:
            if start > state.num_context:
                raise MissingContextError(start, state.num_context)
            if states.ndim != 2 or states.shape[1] != self.config.context_width:
                raise ValueError(f"hidden states must be [tokens, {self.config.context_width}] "
                                 f"(num_target_layers x target_hidden_size), got "
                                 f"{list(states.shape)}")
        if not items:
            return
        model = self.model
        device = model.embed_tokens.weight.device
        states = torch.cat([s for _, _, s in items]).to(device=device, dtype=self.dtype)
        positions = torch.cat([torch.arange(start, start + s.shape[0], device=device)
                               for _, start, s in items])
        context = model.context_norm(model.context_proj(states))
        rope = rope_cos_sin(positions, self.config.rope_dim, self.config.rope_theta, self.dtype)
        rows = [layer.self_attn.latent_rows(context, rope) for layer in model.layers]
        offset = 0
        for state, start, s in items:
            end = offset + s.shape[0]
            state.cache.truncate(start)
            for layer_rows, kv in zip(rows, state.cache.layers, strict=True):
                kv.extend(layer_rows[offset:end])
            offset = end

    @torch.inference_mode()
    def propose_batch(self, states: Sequence[ContextState], block_size: int) -> list[list[int]]:
        """`block_size` greedy drafts per state (fewer where `max_model_len` or the drafter's
        `max_position_embeddings` leaves less room; none for an empty context), one pass."""
        live = [(i, s) for i, s in enumerate(states) if self._room(s, block_size) > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not live or block_size < 1:
            return drafts
        batch = [s for _, s in live]
        base = self.block_logits(batch, block_size)  # [B, N, vocab]
        rows = markov_decode(self.model, base, self._anchors(batch))
        for (i, state), row in zip(live, rows, strict=True):
            drafts[i] = row[: self._room(state, block_size)]
        return drafts

    def block_logits(self, states: Sequence[ContextState], block_size: int) -> torch.Tensor:
        """Base logits of every state's query block, `[len(states), block_size, vocab]`."""
        model, n = self.model, block_size
        device = model.embed_tokens.weight.device
        anchors = self._anchors(states)
        # The anchor sits at its own position (its index), after the context rows.
        start = torch.tensor([len(s.token_ids) - 1 for s in states], device=device)
        positions = (start[:, None] + torch.arange(n, device=device)).reshape(-1)
        rope = rope_cos_sin(positions, self.config.rope_dim, self.config.rope_theta, self.dtype)
        mask_embedding = model.embed_tokens.weight[self.config.mask_token_id]
        h = torch.cat([model.embed_tokens(anchors)[:, None],
                       mask_embedding.expand(len(states), n - 1, -1)], dim=1)
        lengths = torch.tensor([s.num_context for s in states], device=device)
        longest = int(lengths.max())
        visible = torch.cat([torch.arange(longest, device=device)[None] < lengths[:, None],
                             torch.ones(len(states), n, dtype=torch.bool, device=device)], dim=1)
        for index, layer in enumerate(model.layers):
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            context = pad_rows([s.cache.layers[index] for s in states], longest,
                               width=attn.kv_lora_rank + attn.rope_dim, like=h)
            h = h + block_attention(attn, x, rope, context, visible[:, None, None])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = model.final_norm(h)
        return model.compute_logits(hidden.reshape(len(states) * n, -1)).view(len(states), n, -1)

    def _anchors(self, states: Sequence[ContextState]) -> torch.Tensor:
        device = self.model.embed_tokens.weight.device
        return torch.tensor([s.token_ids[-1] for s in states], dtype=torch.long, device=device)

    def _room(self, state: ContextState, k: int) -> int:
        return block_room(self.config, self.max_model_len, len(state.token_ids), k)


def pad_rows(layers: Sequence[LayerKV], length: int, width: int,
             like: torch.Tensor) -> torch.Tensor:
    """Each request's cached rows of one layer, zero-padded to `length`: `[B, length, width]`
    in `like`'s dtype and device."""
    out = like.new_zeros(len(layers), length, width)
    for i, kv in enumerate(layers):
        rows = kv.rows()
        if rows is not None and rows.shape[0]:
            out[i, : rows.shape[0]] = rows
    return out


def block_attention(attn: MLAttention, x: torch.Tensor, rope: tuple, context: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
    """MLA of each request's query block `x` `[B, N, hidden]` over its context rows
    `[B, L, kv_lora + rope]` and its own block (non-causal); `visible` `[B, 1, 1, L + N]`."""
    batch, n, _ = x.shape
    flat = x.reshape(batch * n, -1)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(flat))).view(batch * n, attn.num_heads, -1)
    q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    block_rows = attn.latent_rows(flat, rope).view(batch, n, -1)
    keys = torch.cat([context, block_rows], dim=1)
    w_uk, w_uv = attn.absorbed_weights(q.dtype)
    query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk),
                       apply_rope(q_pe, *rope, interleaved=True)], dim=-1)
    query = query.view(batch, n, attn.num_heads, -1).transpose(1, 2)  # [B, heads, N, width]
    # One latent key/value head shared by all heads (MLA's MQA form): two batched matmuls, no
    # per-head copy of the keys.
    scores = torch.einsum("bhnc,blc->bhnl", query, keys) * attn.scale
    scores = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    latent = torch.einsum("bhnl,blc->bhnc", scores, keys[..., : attn.kv_lora_rank])
    latent = latent.transpose(1, 2).reshape(batch * n, attn.num_heads, -1)
    out = torch.einsum("thc,hvc->thv", latent, w_uv)
    return attn.o_proj(out.reshape(batch * n, -1)).view(batch, n, -1)


def markov_decode(model: DSparkModel, base: torch.Tensor, anchors: torch.Tensor) -> list[list[int]]:
    """The sequential Markov stage over base logits `[B, N, vocab]`, greedy, batched."""
    head, prev, drafts = model.markov_head, anchors, []
    for i in range(base.shape[1]):
        bias = head.markov_w2(head.markov_w1(prev)).float()
        prev = torch.argmax(base[:, i] + bias, dim=-1)
        drafts.append(prev)
    return torch.stack(drafts, dim=1).tolist()
