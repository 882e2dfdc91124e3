"""`ServiceSpeculator`: the DraftService's drafts on vLLM's model runner V2 (GPUs).

vLLM 0.32 runs model runner V2 on GPUs (`VllmConfig.use_v2_model_runner`) unless a feature it
lacks is configured, and `custom_class`, the method the service path hands vLLM
(`ServiceProposer`), is one of them: vLLM falls back to V1 and drops V2's decode path, and with
`VLLM_USE_V2_MODEL_RUNNER=1` (vLLM's K3 recipe on NVIDIA) the engine does not start. V2 takes no
proposer class: `init_speculator` (vllm/v1/worker/gpu/spec_decode/__init__.py) builds its
speculator from the method's name. On GPUs, moonserve's vLLM plugin (`vllm_plugin.py`) makes
`init_speculator` build this class for `ServiceProposer` and takes custom_class off V2's list
of unsupported features for it. vLLM's CPU build has no V2 (it needs Triton), so there V1 runs
`ServiceProposer`.

What V2 asks of a speculator (`BaseSpeculator`): after each step's sampling, `propose` returns a
[num_reqs, k] int64 tensor on the device, the drafts each batch row verifies in the next step.
V2 verifies k drafts in every decode row (uniform rows are what its decode CUDA graphs replay),
so every slot holds a token: the DraftService's draft where it sent one, else the row's last
sampled token (the filler, as vLLM's V2 n-gram speculator fills its empty slots). Seeded sampled
requests always get the filler, so their output does not depend on whether a reply came in time.
Each slot is verified whatever it holds, so the message asks for full depth (`min_acceptance`
0): any draft beats the filler. Under load vLLM's own `num_speculative_tokens_per_batch_size`
lowers k.

Per step, the call waiting for the step's tokens as V1's does:
1. One gather on the device, copied to the host in one piece: per row, its request's length, the
   tokens it sampled this step, and its last k + 1 tokens (the most one step adds). A row whose
   request the service lacks more of (its first row: the prompt; a resend) copies that slice too.
2. The rows go to the DraftService in one message, with the bookkeeping V1 uses (`DraftBook`);
   the reply's drafts are copied to the device over the filler.
3. Tensor parallelism: rank 0 calls, and the drafts reach the other ranks by the TP group's
   device broadcast.

The target's hidden states (`MOONSERVE_DRAFT_HIDDEN_LAYERS`, the `dspark_context` drafter): V1
keeps them with forward hooks, which compiled graphs skip. On V2 the target returns them itself,
as it does for vLLM's own EAGLE-3 and DSpark speculators: vLLM's aux hidden states, the residual
stream after decoder layer i as aux id i + 1 (the plugin sets the layers right after the model
loads, before anything is compiled or captured). `propose` gets them for every token of the step;
per row it keeps the ones the target accepted (`HiddenStates`, shared with V1), which go with
the request's next row until the service confirms them.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from moonserve.pipeline.engine.proposer import (
    ENV_HIDDEN_LAYERS,
    DraftBook,
    HiddenStates,
    ProposerStats,
    check_layer_ids,
    decoder_layers,
    draft_client,
    hidden_layers,
)


class ServiceSpeculator(BaseSpeculator):
    """vLLM model runner V2's speculator for `ServiceProposer`; see the module docstring."""

    supports_mm_inputs = False
    draft_logits = None

    def __init__(self, vllm_config, device: torch.device, req_states, sampling_states=None):
        """`sampling_states`: a callable giving the runner's `sampler.sampling_states` (made after
        the speculator), read at each step for which requests are seeded and sampled."""
        self.hidden_layers = hidden_layers()
        if list(self.hidden_layers) != sorted(set(self.hidden_layers)):
            raise ValueError(f"{ENV_HIDDEN_LAYERS}: layers {list(self.hidden_layers)}: on vLLM's "
                             "model runner V2 give them in increasing order, each once (the "
                             "target returns its aux hidden states in layer order)")
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.device = device
        self.req_states = req_states
        self.sampling_states = sampling_states
        self.stats = ProposerStats()
        self.book = DraftBook(self.k, self.max_model_len, self.stats,
                              HiddenStates() if self.hidden_layers else None)
        self.client = draft_client(self.stats)
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        # Batch-ordered drafts, scattered into the request states by the model runner.
        self.drafts = torch.zeros((max_num_reqs, self.k), dtype=torch.int64, device=device)
        # Offsets of a request's last k + 1 tokens from its length: the most one step adds.
        self.recent_offsets = torch.arange(-(self.k + 1), 0, device=device)

    def set_aux_layers(self, model) -> None:
        """Make the loaded target return its hidden states at `hidden_layers` with its output
        (vLLM's `set_aux_hidden_state_layers`: aux id i + 1 is the residual stream after layer
        i, what V1's `HiddenCapture` keeps)."""
        check_layer_ids(self.hidden_layers, len(decoder_layers(model)))
        model.set_aux_hidden_state_layers(tuple(i + 1 for i in self.hidden_layers))

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """Nothing to capture: the drafts come from another process."""

    def capture(self) -> None:
        """Nothing to capture."""

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                temperature, seeds, dp_sync_state=None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        n = input_batch.num_reqs
        idx = input_batch.idx_mapping[:n]
        drafts = self.drafts[:n]
        drafts.copy_(last_sampled[idx].expand(n, self.k))  # the filler
        if dummy_run or is_profile or n == 0:
            return drafts
        group = None
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            group = get_tp_group()
        if group is None or group.rank_in_group == 0:
            answers = self._call(input_batch, idx, num_sampled[:n], aux_hidden_states)
            if answers:
                host = torch.full((n, self.k), -1, dtype=torch.int64)
                for row, tokens in answers.items():
                    host[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
                host = host.to(self.device)
                drafts.copy_(torch.where(host >= 0, host, drafts))
        if group is not None:
            group.broadcast(drafts, src=0)
        return drafts

    def _call(self, input_batch, idx: torch.Tensor, num_sampled: torch.Tensor,
              aux_hidden_states) -> dict[int, list[int]] | None:
        """This step's message to the DraftService and its reply: batch row -> drafts."""
        tokens = self.req_states.all_token_ids.gpu
        total = self.req_states.total_len.gpu[idx].long()
        recent = tokens[idx[:, None], (total[:, None] + self.recent_offsets).clamp(min=0)]
        packed = torch.cat([total[:, None], num_sampled[:, None].long(), recent.long()], 1).cpu()
        totals, sampled, recent = packed[:, 0].tolist(), packed[:, 1].tolist(), packed[:, 2:]
        if self.book.hidden is not None:
            if not aux_hidden_states:
                raise RuntimeError("the target returned no aux hidden states: the plugin sets "
                                   "them when the model loads (vllm_plugin.py)")
            self.book.hidden.collect(
                input_batch.req_ids, totals, input_batch.query_start_loc_np,
                input_batch.positions,
                lambda start, end: torch.cat([a[start:end] for a in aux_hidden_states], dim=-1))
        slots = input_batch.idx_mapping_np[:len(totals)]
        seeded = self._seeded(slots)
        candidates = [(i, totals[i]) for i in range(len(totals)) if sampled[i] and not seeded[i]]

        def row_tokens(i: int, start: int, end: int) -> list[int]:
            """Tokens [start, end) of row i: from its last k + 1, else copied for this row."""
            if end - start <= recent.shape[1]:
                return recent[i, recent.shape[1] - (end - start):].tolist()
            return tokens[int(slots[i]), start:end].tolist()

        plan = self.book.plan(input_batch.req_ids, candidates, row_tokens, 0.0)
        if plan is None:
            return None
        return self.book.answers(plan, self.client.call(plan.request))

    def _seeded(self, slots) -> list[bool]:
        """Per row: a sampled request with a `seed` (it gets only the filler)."""
        states = self.sampling_states() if self.sampling_states is not None else None
        if states is None:
            return [False] * len(slots)
        return [bool(s) and float(t) > 0.0 for s, t in
                zip(states.seeds_set[slots], states.temperature.np[slots], strict=True)]
