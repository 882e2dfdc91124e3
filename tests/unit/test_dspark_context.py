"""The DraftService's K3 DSpark drafter over the target's hidden states (`dspark_context`).

vLLM's DSpark speculator runs only on a GPU (Triton kernels, CUDA graphs, the v2 model runner),
so `VllmDSpark` below ports its drafting step by step: `K3DSparkModel.combine_hidden_states`,
`precompute_and_store_context_kv`, `K3DSparkDecoderLayer.forward`, MLA attention (here unabsorbed:
`kv_b_proj` expands the latent into per-head keys and values), the query layout of
`_prepare_dflash_inputs_kernel` with `SAMPLE_FROM_ANCHOR`, and
`DSparkSpeculator._sample_sequential`.
It uses vLLM's own `RMSNorm`, rotary embedding (`get_rope`, `is_neox_style=False` as K3's MLA
builds it), `DSparkMarkovHead` and `LogitsProcessor`. The weights carry the names
`K3DSparkForCausalLM.load_weights` reads, and the config is checked by vLLM's `K3DSparkConfig`.
The batched drafter must give the same drafts for every request, and logits within float error.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from moonserve.pipeline.models.dspark import DSparkConfig
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.dspark_context import (
    ContextDSparkDrafter,
    MissingContextError,
)
from moonserve.pipeline.speculative.service import DraftCore
from moonserve.pipeline.speculative.wire import Row, StepRequest
from moonserve.pipeline.synthetic_checkpoints.k3_random_weights import dspark_expected_tensors

CONFIG = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
    "vocab_size": 96, "draft_vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "rope_theta": 50000.0,
    "max_position_embeddings": 256, "target_hidden_size": 40, "target_layer_ids": [0, 2, 3],
    "num_target_layers": 3, "markov_rank": 8, "dspark_noise_token_id": 3,
    "tie_word_embeddings": False,
}
TARGET_WIDTH = CONFIG["target_hidden_size"] * CONFIG["num_target_layers"]


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor vLLM's loader reads, plus the target's embedding and LM head; scaled so the
    logits' top two are far apart (a draft then cannot flip on float rounding)."""
    g = torch.Generator().manual_seed(seed)
    shapes = dspark_expected_tensors(CONFIG)
    shapes |= {"embed_tokens.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"]),
               "lm_head.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"])}
    return {name: (1 + 0.2 * torch.randn(shape, generator=g)) if name.endswith("norm.weight")
            else 0.3 * torch.randn(shape, generator=g) for name, shape in shapes.items()}


class VllmDSpark:
    """One request's DSpark draft as vLLM computes it (see the module doc), unbatched."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
        from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

        self.c = K3DSparkConfig(**CONFIG)  # vLLM's own reading of the config
        self.t = tensors
        with set_current_vllm_config(VllmConfig()):
            self.norms = {}
            for name, weight in tensors.items():
                if name.endswith("norm.weight"):
                    norm = RMSNorm(weight.shape[0], eps=self.c.rms_norm_eps)
                    norm.weight.data.copy_(weight)
                    self.norms[name.removesuffix(".weight")] = norm
            self.rope = get_rope(self.c.qk_rope_head_dim,
                                 max_position=self.c.max_position_embeddings,
                                 rope_parameters=dict(self.c.rope_parameters),
                                 is_neox_style=False, dtype=torch.float32)
            self.markov = DSparkMarkovHead(self.c.vocab_size, self.c.draft_vocab_size,
                                           self.c.markov_rank, prefix="markov_head")
            self.markov.markov_w1.weight.data.copy_(tensors["markov_head.markov_w1.weight"])
            vocab = self.c.vocab_size  # ParallelLMHead pads its rows; LogitsProcessor drops them
            self.markov.markov_w2.weight.data[:vocab].copy_(tensors["markov_head.markov_w2.weight"])
            dispatch_cpu_unquantized_gemm(self.markov.markov_w2, remove_weight=False)
            self.logits = LogitsProcessor(self.c.draft_vocab_size)
            self.lm_head = ParallelLMHead(vocab, self.c.hidden_size, disable_tp=True)
            self.lm_head.weight.data[:vocab].copy_(tensors["lm_head.weight"])
            dispatch_cpu_unquantized_gemm(self.lm_head, remove_weight=False)

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.t[f"{name}.weight"].T

    def rotate(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor):
        if not len(positions):  # vLLM's rotary embedding cannot take zero tokens
            return q_pe, k_pe
        q, k = self.rope.forward_native(positions, q_pe.flatten(1).clone(),
                                        k_pe.clone())
        return q.view(q_pe.shape), k

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """precompute_and_store_context_kv: per draft layer (kv_c_normed, roped k_pe)."""
        context = self.norms["context_norm"](self.linear("context_proj", states))
        out = []
        for i in range(self.c.num_hidden_layers):
            a = f"layers.{i}.self_attn"
            kv = self.linear(f"{a}.kv_a_proj_with_mqa", context)
            kv_c, k_pe = kv.split([self.c.kv_lora_rank, self.c.qk_rope_head_dim], dim=-1)
            _, k_pe = self.rotate(positions, k_pe, k_pe)  # the query half is unused here
            out.append((self.norms[f"{a}.kv_a_layernorm"](kv_c), k_pe))
        return out

    def draft(self, context: list[tuple], anchor: int, position: int, n: int):
        """(base logits [n, vocab], drafts) of the query block at `position`."""
        c = self.c
        ids = torch.tensor([anchor] + [c.dspark_noise_token_id] * (n - 1))
        positions = torch.arange(position, position + n)
        h, residual = self.t["embed_tokens.weight"][ids], None
        for i in range(c.num_hidden_layers):
            p, a = f"layers.{i}", f"layers.{i}.self_attn"
            if residual is None:
                residual, h = h, self.norms[f"{p}.input_layernorm"](h)
            else:
                residual = h + residual
                h = self.norms[f"{p}.input_layernorm"](residual)
            q = self.linear(f"{a}.q_b_proj",
                            self.norms[f"{a}.q_a_layernorm"](self.linear(f"{a}.q_a_proj", h)))
            q = q.view(n, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
            q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
            kv_c, k_pe = self.linear(f"{a}.kv_a_proj_with_mqa", h).split(
                [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            q_pe, k_pe = self.rotate(positions, q_pe, k_pe)
            kv_c = torch.cat([context[i][0], self.norms[f"{a}.kv_a_layernorm"](kv_c)])
            k_pe = torch.cat([context[i][1], k_pe])
            kv = self.linear(f"{a}.kv_b_proj", kv_c).view(
                len(kv_c), c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None].expand(-1, c.num_attention_heads, -1)], dim=-1)
            scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k)
            weights = (scores * (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5).softmax(-1)
            attn = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, -1)  # non-causal
            residual = self.linear(f"{a}.o_proj", attn) + residual
            h = self.norms[f"{p}.post_attention_layernorm"](residual)
            m = f"{p}.mlp"
            h = self.linear(f"{m}.down_proj", torch.nn.functional.silu(
                self.linear(f"{m}.gate_proj", h)) * self.linear(f"{m}.up_proj", h))
        hidden = self.norms["final_norm"](h + residual)
        base = self.logits(self.lm_head, hidden)
        prev, drafts = torch.tensor([anchor]), []
        for i in range(n):
            bias = self.markov.bias(self.markov.embed(prev), self.logits)
            prev = (base[i : i + 1] + bias).argmax(dim=-1)
            drafts.append(int(prev))
        return base, drafts


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A K3 DSpark checkpoint dir (vLLM's names) and the target's shared tensors."""
    tensors = random_weights()
    directory = tmp_path_factory.mktemp("dspark")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    shared = {name: tensors.pop(name) for name in ("embed_tokens.weight", "lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, tensors | shared, shared


@pytest.fixture(scope="module")
def reference(weights):
    return VllmDSpark(weights[1])


@pytest.fixture
def drafter(weights):
    directory, _, shared = weights
    return ContextDSparkDrafter.from_pretrained(directory, shared=shared)


def request(drafter, seed: int, num_tokens: int, num_context: int | None = None):
    """A state of `num_tokens` tokens, hidden states for all but the anchor (or
    `num_context`); returns (state, tokens, hidden states)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, CONFIG["vocab_size"], (num_tokens,), generator=g).tolist()
    num_context = num_tokens - 1 if num_context is None else num_context
    states = torch.randn(num_context, TARGET_WIDTH, generator=g)
    state = drafter.new_state(f"r{seed}")
    state.append(tokens)
    return state, tokens, states


def test_batched_drafts_equal_vllm_dspark_per_request(drafter, reference):
    """One pass over requests with contexts of 0, 1, 6 and 11 tokens at k = 4 gives each
    request vLLM's drafts and base logits."""
    requests = [request(drafter, seed, n, c) for seed, (n, c) in
                enumerate([(12, None), (2, None), (7, None), (5, 0)])]
    drafter.add_contexts([(state, 0, states) for state, _, states in requests])
    base = drafter.block_logits([state for state, _, _ in requests], 4)
    drafts = drafter.propose_batch([state for state, _, _ in requests], 4)
    for i, (state, tokens, states) in enumerate(requests):
        context = reference.context_kv(states, torch.arange(len(states)))
        expected_base, expected = reference.draft(context, tokens[-1], len(tokens) - 1, 4)
        torch.testing.assert_close(base[i], expected_base, atol=2e-4, rtol=2e-4)
        assert drafts[i] == expected, f"request {i}"
    assert len({tuple(d) for d in drafts}) == len(drafts)  # the requests drafted apart


def test_context_in_steps_and_resends_equal_one_shot(drafter, reference):
    """Hidden states added step by step, a resend that replaces rows, and a duplicate (a second
    tensor-parallel rank) leave the same context as sending it once."""
    state, tokens, states = request(drafter, 7, 10)
    drafter.add_contexts([(state, 0, states[:4])])
    drafter.add_contexts([(state, 4, torch.randn(5, TARGET_WIDTH))])  # a step later rejected
    drafter.add_contexts([(state, 4, states[4:])])  # the resend replaces positions 4..8
    drafter.add_contexts([(state, 4, states[4:])])  # the duplicate
    assert state.num_context == 9
    context = reference.context_kv(states, torch.arange(9))
    assert drafter.propose_batch([state], 5)[0] == reference.draft(context, tokens[-1], 9, 5)[1]


def test_truncate_drops_tokens_and_their_context(drafter, reference):
    state, tokens, states = request(drafter, 8, 10)
    drafter.add_contexts([(state, 0, states)])
    state.truncate(6)  # rejected: tokens 6.. and their context rows go
    state.append([11])
    assert state.num_context == 6 and list(state.token_ids) == tokens[:6] + [11]
    context = reference.context_kv(states[:6], torch.arange(6))
    assert state.propose(3) == reference.draft(context, 11, 6, 3)[1]


def test_context_past_the_held_rows_is_refused(drafter):
    state, _, states = request(drafter, 9, 6)
    drafter.add_contexts([(state, 0, states[:2])])
    with pytest.raises(MissingContextError, match=r"start at position 4.*\[0, 2\)"):
        drafter.add_contexts([(state, 4, states[4:])])
    with pytest.raises(ValueError, match=r"\[tokens, 120\]"):
        drafter.add_contexts([(state, 2, states[2:, :-1])])
    assert state.num_context == 2


def test_room_caps_the_block(weights):
    directory, _, shared = weights
    capped = ContextDSparkDrafter.from_pretrained(directory, shared=shared, max_model_len=12)
    state, _, states = request(capped, 10, 10)
    capped.add_contexts([(state, 0, states)])
    empty = capped.new_state("empty")
    assert [len(d) for d in capped.propose_batch([state, empty], 4)] == [2, 0]


def test_config_reads_vllm_names_and_needs_a_mask_token(weights):
    directory, _, shared = weights
    config = DSparkConfig.from_json(directory / "config.json")
    assert (config.mask_token_id, config.context_width) == (3, TARGET_WIDTH)
    data = {k: v for k, v in CONFIG.items() if k != "dspark_noise_token_id"}
    (directory / "config.json").write_text(json.dumps(data))
    try:
        with pytest.raises(ValueError, match="mask_token_id"):
            ContextDSparkDrafter.from_pretrained(directory, shared=shared)
    finally:
        (directory / "config.json").write_text(json.dumps(CONFIG))


class CountingDrafter(ContextDSparkDrafter):
    """Counts forward passes over query blocks."""

    passes = 0

    def block_logits(self, states, block_size):
        CountingDrafter.passes += 1
        return super().block_logits(states, block_size)


def step_message(rows, k=4, dtype="float32"):
    return msgspec.to_builtins(StepRequest(seq=1, k=k, rows=rows, hidden_dtype=dtype),
                               builtin_types=(bytes,))


def test_draft_core_drafts_a_step_of_hidden_states_in_one_pass(weights, reference):
    """Rows with hidden states on the wire: one block pass for the whole step, vLLM's drafts per
    row; a row whose hidden states start past the held context is asked to resend."""
    directory, _, shared = weights
    drafter = CountingDrafter.from_pretrained(directory, shared=shared)
    core = DraftCore({"dspark_context": lambda: drafter}, "dspark_context",
                     adaptive=AdaptivePolicy(enabled=False))
    requests = [request(drafter, seed, n) for seed, n in [(20, 9), (21, 4), (22, 6)]]
    rows = [Row(f"q{i}", 0, tokens, 0, states.numpy().tobytes())
            for i, (_, tokens, states) in enumerate(requests)]
    CountingDrafter.passes = 0
    reply, observation = core.step(step_message(rows))
    assert CountingDrafter.passes == 1 and observation.num_drafts == [4, 4, 4]
    for (_, tokens, states), drafts in zip(requests, reply["drafts"], strict=True):
        context = reference.context_kv(states, torch.arange(len(states)))
        assert drafts == reference.draft(context, tokens[-1], len(tokens) - 1, 4)[1]
    # Next step of q0: its anchor and one accepted draft ran, hidden states for 8 and 9 arrive.
    _, tokens, states = requests[0]
    more = torch.randn(2, TARGET_WIDTH)
    accepted = [*tokens, reply["drafts"][0][0], 17]
    gap = Row("q1", 4, [30], 5, more[:1].numpy().tobytes())  # q1 holds context [0, 3)
    reply, _ = core.step(step_message([Row("q0", 9, accepted[9:], 8, more.numpy().tobytes()),
                                       gap]))
    assert reply["resend_from"] == [-1, 4] and reply["drafts"][1] == []
    context = reference.context_kv(torch.cat([states, more]), torch.arange(10))
    assert reply["drafts"][0] == reference.draft(context, 17, 10, 4)[1]
    assert core.prefetch() == 0  # drafts past the target's tokens would have no hidden states


def test_hidden_bytes_that_are_not_whole_rows_fail_the_step(weights):
    directory, _, shared = weights
    core = DraftCore({"dspark_context": lambda: ContextDSparkDrafter.from_pretrained(
        directory, shared=shared)}, "dspark_context")
    bad = Row("q", 0, [5, 6], 0, torch.zeros(TARGET_WIDTH + 1).numpy().tobytes())
    with pytest.raises(ValueError, match="not whole rows of the drafter's context_width 120"):
        core.step(step_message([bad]))
    with pytest.raises(ValueError, match="hidden_dtype must be one of"):
        core.step(step_message([bad], dtype="int8"))
