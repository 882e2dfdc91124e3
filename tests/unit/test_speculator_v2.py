"""The DraftService on vLLM's model runner V2 (`ServiceSpeculator`,
pipeline/engine/speculator_v2.py).

V2 cannot run on this CPU build (it needs Triton), so:
- vLLM's own `VllmConfig` (the embedded model's engine, `draft.mode: service`) and vLLM's own
  `init_speculator` say what the plugin's hook changes: custom_class leaves V2's unsupported list
  and `init_speculator` builds `ServiceSpeculator`, for `ServiceProposer` only.
- `ServiceSpeculator.propose` runs on CPU tensors laid out as V2's request states (a stand-in:
  V2's `RequestState` allocates pinned memory, which needs a GPU), against a real `DraftCore`
  (n-gram drafter) in this process, each message encoded and decoded as on the wire; a
  simulated greedy target decodes known texts in a batch whose order changes every step.
The GPU smoke script runs the engine itself.
"""

from __future__ import annotations

import copy
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moonserve.deployments.builder import resolve_model_path
from moonserve.deployments.language_model import engine_args
from moonserve.pipeline.config import DEFAULT_CONFIG, DraftConfig, load_app_config
from moonserve.pipeline.engine import vllm_plugin
from moonserve.pipeline.speculative.adaptive import AdaptivePolicy
from moonserve.pipeline.speculative.ngram import NgramDrafter
from moonserve.pipeline.speculative.service import DraftCore, decode_hidden
from moonserve.pipeline.speculative.wire import StepReply, StepRequest
from tests.unit.test_proposer_quiet import CoreClient, copyable

K, MAX_LEN, SLOTS = 4, 1024, 8


@pytest.fixture
def draft_socket(monkeypatch, tmp_path):
    """The LanguageModel replica's resolver socket variable (the speculator's client connects on
    its first call, which these tests make through `CoreClient` instead)."""
    monkeypatch.setenv("MOONSERVE_DRAFT_SOCKET", str(tmp_path / "resolver.sock"))
    monkeypatch.delenv("MOONSERVE_DRAFT_HIDDEN_LAYERS", raising=False)


@pytest.fixture
def plugin_v2():
    """The plugin's GPU hook applied in this process, and taken off again afterwards."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu import spec_decode

    saved = spec_decode.init_speculator, VllmConfig._get_v2_model_runner_unsupported_features
    runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    saved_runner = getattr(runner, "init_speculator", None)
    vllm_plugin.service_speculator_on_v2()
    yield spec_decode
    spec_decode.init_speculator, VllmConfig._get_v2_model_runner_unsupported_features = saved
    if runner is not None:
        runner.init_speculator = saved_runner


@pytest.fixture(scope="module")
def service_config():
    """vLLM's `VllmConfig` for the embedded model with `draft.mode: service`."""
    app = load_app_config(DEFAULT_CONFIG)
    draft = app.draft.model_copy(update={"mode": "service", "num_speculative_tokens": K})
    lm = app.language_model
    return engine_args(lm.engine, resolve_model_path(lm), draft).create_engine_config()


def other_custom_class(vllm_config):
    other = copy.copy(vllm_config)
    other.speculative_config = copy.copy(vllm_config.speculative_config)
    other.speculative_config.model = "somewhere.else.Proposer"
    return other


def test_the_service_proposer_is_the_class_the_plugin_names():
    assert DraftConfig(mode="service").speculative_config()["model"] == \
        vllm_plugin.SERVICE_PROPOSER


def test_v2_takes_the_service_proposer_only_through_the_plugin(service_config, plugin_v2,
                                                               draft_socket):
    from vllm.config import VllmConfig

    from moonserve.pipeline.engine.speculator_v2 import ServiceSpeculator

    spec = service_config.speculative_config
    assert (spec.method, spec.model) == ("custom_class", vllm_plugin.SERVICE_PROPOSER)
    unsupported = VllmConfig._get_v2_model_runner_unsupported_features
    assert vllm_plugin.V2_UNSUPPORTED not in unsupported(service_config)
    assert vllm_plugin.V2_UNSUPPORTED in unsupported(other_custom_class(service_config))

    built = plugin_v2.init_speculator(service_config, torch.device("cpu"), stand_in_states())
    assert isinstance(built, ServiceSpeculator)
    assert built.drafts.shape == (service_config.scheduler_config.max_num_seqs, K)
    with pytest.raises(NotImplementedError, match="custom_class"):  # vLLM's own answer
        plugin_v2.init_speculator(other_custom_class(service_config), torch.device("cpu"),
                                  stand_in_states())


def test_without_the_plugin_v2_refuses_the_service_proposer(service_config):
    """Why the hook exists: vLLM alone lists custom_class as unsupported on V2 (and falls back
    to V1), and its `init_speculator` has no path for it."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu import spec_decode

    assert vllm_plugin.V2_UNSUPPORTED in \
        VllmConfig._get_v2_model_runner_unsupported_features(service_config)
    with pytest.raises(NotImplementedError, match="custom_class"):
        spec_decode.init_speculator(service_config, torch.device("cpu"), stand_in_states())


def test_hidden_layers_out_of_order_are_refused_with_a_message(service_config, draft_socket,
                                                               monkeypatch):
    from moonserve.pipeline.engine.speculator_v2 import ServiceSpeculator

    monkeypatch.setenv("MOONSERVE_DRAFT_HIDDEN_LAYERS", "3,1")
    with pytest.raises(ValueError, match=r"MOONSERVE_DRAFT_HIDDEN_LAYERS: layers \[3, 1\].*order"):
        ServiceSpeculator(service_config, torch.device("cpu"), stand_in_states())


class StandInRunner:
    """What the plugin's hook touches of V2's model runner: it builds its speculator in its
    constructor (the frame the hook reads `self` from), then loads the model."""

    def __init__(self, spec_decode, vllm_config):
        self.use_aux_hidden_state_outputs = False
        self.speculator = spec_decode.init_speculator(vllm_config, torch.device("cpu"),
                                                      stand_in_states())

    def load_model(self) -> None:
        layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(4))
        self.model = SimpleNamespace(model=SimpleNamespace(layers=layers), aux_layers=None)
        self.model.set_aux_hidden_state_layers = \
            lambda ids: setattr(self.model, "aux_layers", ids)


@pytest.mark.parametrize("layers, aux", [("0,2,3", (1, 3, 4)), ("1,4", None)])
def test_with_hidden_layers_the_target_returns_them_as_aux_hidden_states(
        service_config, plugin_v2, draft_socket, monkeypatch, layers, aux):
    """The runner's aux outputs are on before it loads the model, and the layers are set as soon
    as it has (vLLM's ids: layer i -> aux i + 1); a layer the target lacks fails the load."""
    monkeypatch.setenv("MOONSERVE_DRAFT_HIDDEN_LAYERS", layers)
    runner = StandInRunner(plugin_v2, service_config)
    assert runner.use_aux_hidden_state_outputs
    if aux is None:
        with pytest.raises(ValueError, match=r"layers \[4\] are not among the target's 4"):
            runner.load_model()
        return
    runner.load_model()
    assert runner.model.aux_layers == aux


# ---- propose, step by step -------------------------------------------------------------------


def stand_in_states():
    """The fields of V2's `RequestState` the speculator reads, by slot."""
    return SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32)),
        total_len=SimpleNamespace(gpu=torch.zeros(SLOTS, dtype=torch.int32)),
        last_sampled_tokens=torch.zeros(SLOTS, 1, dtype=torch.int64))


class Target:
    """A greedy target decoding known texts in V2's layout: each request in a slot of the
    request states, the batch in a new order every step."""

    def __init__(self, seeded: set[str], client=CoreClient):
        from moonserve.pipeline.engine.speculator_v2 import ServiceSpeculator

        config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=K),
            model_config=SimpleNamespace(max_model_len=MAX_LEN),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
        self.states = stand_in_states()
        self.sampling = SimpleNamespace(seeds_set=np.zeros(SLOTS, dtype=bool),
                                        temperature=SimpleNamespace(np=np.zeros(SLOTS)))
        self.spec = ServiceSpeculator(config, torch.device("cpu"), self.states,
                                      lambda: self.sampling)
        self.core = DraftCore({"ngram": lambda: NgramDrafter(min_n=2, max_n=4)}, "ngram",
                              prefetch=False, adaptive=AdaptivePolicy())
        self.spec.client = self.client = client(self.core)
        self.seeded = seeded
        self.texts: dict[str, list[int]] = {}
        self.slot: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self.computed: dict[str, int] = {}  # tokens in the KV cache (the newest one is not)
        self.code: dict[str, int] = {}  # the request's mark in its hidden states
        self.drafts: dict[str, list[int]] = {}
        self.accepted = 0

    def admit(self, request_id: str, text: list[int], prompt_len: int, slot: int) -> None:
        self.texts[request_id], self.slot[request_id] = text, slot
        self.length[request_id], self.drafts[request_id] = prompt_len, []
        self.computed[request_id], self.code[request_id] = 0, len(self.code) + 1
        self.states.all_token_ids.gpu[slot] = 0
        self.states.all_token_ids.gpu[slot, :prompt_len] = torch.tensor(text[:prompt_len])
        self.states.total_len.gpu[slot] = prompt_len
        seeded = request_id in self.seeded
        self.sampling.seeds_set[slot] = seeded
        self.sampling.temperature.np[slot] = 1.0 if seeded else 0.0

    def step(self, order: list[str], prefilling: set[str] = frozenset()) -> torch.Tensor:
        """One engine step over `order`: each row keeps the drafts that match its text and adds a
        token (a row in `prefilling` is a prefill chunk of 13 tokens: it samples nothing); then
        `propose`, with the pass's layout and a hidden state per token and layer that marks the
        request and position (`hidden_code`)."""
        num_sampled, query_start, positions = [], [0], []
        for r in order:
            n, computed = self.length[r], self.computed[r]
            if r in prefilling:
                positions += range(computed, computed + 13)
                self.computed[r] += 13
            elif computed == n - 1:  # decode: the newest token and the K draft slots
                positions += range(n - 1, n + K)
            else:  # the prompt's last chunk
                positions += range(computed, n)
            query_start.append(len(positions))
            if r in prefilling:
                num_sampled.append(0)
                continue
            truth, slot = self.texts[r], self.slot[r]
            kept = 0
            while kept < len(self.drafts[r]) and n + kept < len(truth) - 1 and \
                    self.drafts[r][kept] == truth[n + kept]:
                kept += 1
            new = truth[n:n + kept + 1]
            self.states.all_token_ids.gpu[slot, n:n + len(new)] = torch.tensor(new)
            self.states.total_len.gpu[slot] = n + len(new)
            self.states.last_sampled_tokens[slot, 0] = new[-1]
            self.length[r] += len(new)
            self.computed[r] = self.length[r] - 1
            self.accepted += kept
            num_sampled.append(len(new))
        slots = [self.slot[r] for r in order]
        batch = SimpleNamespace(req_ids=order, num_reqs=len(order), idx_mapping=torch.tensor(slots),
                                idx_mapping_np=np.array(slots), positions=torch.tensor(positions),
                                query_start_loc_np=np.array(query_start))
        codes = torch.tensor([hidden_code(self.code[r], pos) for i, r in enumerate(order)
                              for pos in positions[query_start[i]:query_start[i + 1]]],
                             dtype=torch.float32)
        aux = [codes[:, None] * (j + 1) for j in range(2)]
        out = self.spec.propose(batch, None, None, None, aux,
                                torch.tensor(num_sampled, dtype=torch.int32), None,
                                self.states.last_sampled_tokens, None, None, None)
        assert out.shape == (len(order), K) and out.dtype == torch.int64
        for row, r in enumerate(order):
            self.drafts[r] = out[row].tolist()
        return out

    def done(self, request_id: str) -> bool:
        return self.length[request_id] >= len(self.texts[request_id]) - 1


def hidden_code(request: int, position: int) -> float:
    return float(request * 10_000 + position)


def run_decode(target: Target, rng: random.Random) -> None:
    """Decode four texts (and a fifth in a reused slot) to their ends; see the test below."""
    texts = {name: copyable(rng, 300) for name in ("a", "b", "seeded", "late", "reuser")}
    for slot, name in ((5, "a"), (2, "b"), (0, "seeded"), (6, "late")):
        target.admit(name, texts[name], 40, slot)
    steps = 0
    live, finished = ["a", "b", "seeded", "late"], []
    while live:
        order = live[:]
        rng.shuffle(order)
        prefilling = {"late"} if steps < 3 else set()
        out = target.step(order, prefilling)
        steps += 1
        for row, r in enumerate(order):
            filler = [int(target.states.last_sampled_tokens[target.slot[r], 0])] * K
            if r == "seeded" or r in prefilling:
                assert out[row].tolist() == filler, (r, steps)
                assert r not in target.core.sessions, r
            else:
                assert target.core.sessions.state(r).token_ids == \
                    target.texts[r][:target.length[r]], (r, steps)
        # Requests that left the batch before this step were released by its message.
        assert not any(r in target.core.sessions for r in finished), finished
        finished = [r for r in live if target.done(r)]
        live = [r for r in live if not target.done(r)]
        if "a" in finished:  # "reuser" takes the slot "a" leaves
            target.admit("reuser", texts["reuser"], 60, target.slot["a"])
            live.append("reuser")
    assert all(target.done(r) for r in target.texts), target.length  # "reuser" included


def test_each_request_reaches_the_service_whole_and_its_drafts_come_back_to_its_row(draft_socket):
    """Over a decode in a reshuffled batch, with prefill chunks, a seeded request and a slot
    reused by a new request: after every step the service holds exactly each drafted request's
    tokens; the drafts it sends are verified in the right rows (the target accepts many); a
    seeded request or a prefill chunk gets only its last token as filler and is never sent."""
    target = Target(seeded={"seeded"})
    run_decode(target, random.Random(7))
    # Four non-seeded texts of ~300 tokens, about half copyable: many drafts verified.
    assert target.accepted > 200, target.accepted


class HiddenRows(CoreClient):
    """Checks each message's hidden states on their way to the service: per request, every
    position before the row's newest token exactly once, in order, each the target's own."""

    def __init__(self, core: DraftCore):
        super().__init__(core)
        self.received: dict[str, list[float]] = {}
        self.rows_with_hidden = 0

    def call(self, request: StepRequest) -> StepReply:
        for row in request.rows:
            got = self.received.setdefault(row.request_id, [])
            if row.hidden:
                states = decode_hidden(row.hidden, request.hidden_dtype, 2)
                assert row.hidden_start == len(got), (row.request_id, row.hidden_start, len(got))
                assert torch.equal(states[:, 1], 2 * states[:, 0])
                got += states[:, 0].tolist()
                self.rows_with_hidden += 1
            assert len(got) == row.position + len(row.new_token_ids) - 1, row.request_id
            code = got[0] // 10_000
            assert got == [hidden_code(code, pos) for pos in range(len(got))], row.request_id
        return super().call(request)


def test_the_hidden_states_the_target_accepted_reach_the_service_once_each(draft_socket,
                                                                           monkeypatch):
    """With `MOONSERVE_DRAFT_HIDDEN_LAYERS` the same decode sends, with each row, the target's
    aux hidden states of the positions it accepted since the last row: rejected drafts' rows and
    the newest token's are left out, a prefill's chunks go with the request's first row."""
    monkeypatch.setenv("MOONSERVE_DRAFT_HIDDEN_LAYERS", "0,5")
    target = Target(seeded={"seeded"}, client=HiddenRows)
    run_decode(target, random.Random(11))
    assert set(target.client.received) == {"a", "b", "late", "reuser"}
    assert target.client.rows_with_hidden > 100 and target.accepted > 200
