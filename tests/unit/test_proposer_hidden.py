"""The proposer's side of `dspark_context`: the target's hidden states, kept and sent per request.

`HiddenCapture` hooks decoder layers shaped like vLLM's (each returns `(mlp_out, residual)`);
`HiddenStates` maps the rows of the engine's last pass to requests through the pass's
`query_start_loc` and `positions`, keeps what the target accepted, and sends it with the request's
next row until the DraftService confirms it.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from moonserve.pipeline.engine.proposer import (
    HiddenCapture,
    HiddenStates,
    UnsentHidden,
    hidden_payload,
)
from moonserve.pipeline.speculative.service import decode_hidden
from moonserve.pipeline.speculative.wire import Row

HIDDEN = 6


class Layer(torch.nn.Module):
    """vLLM's decoder layer contract: `(positions, hidden, residual) -> (mlp_out, residual)`."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return residual * self.scale, residual


class Target(torch.nn.Module):
    def __init__(self, num_layers: int = 4):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(Layer(0.5 + i) for i in range(num_layers))

    def forward(self, positions, embeds):
        hidden, residual, streams = embeds, None, []
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
            streams.append(hidden + residual)  # the residual stream after the layer
        return streams


def layout(query_start: list[int], positions: list[int]):
    """A pass's query starts (host) and positions (device), as the model runners keep them."""
    return np.array(query_start), torch.tensor(positions)


def test_capture_keeps_the_residual_stream_after_each_chosen_layer():
    target = Target()
    capture = HiddenCapture(target, (0, 2, 3))
    embeds = torch.randn(5, HIDDEN)
    streams = target(torch.arange(5), embeds)
    expected = torch.cat([streams[0], streams[2], streams[3]], dim=-1)
    torch.testing.assert_close(capture.rows(1, 4), expected[1:4])
    with pytest.raises(ValueError, match=r"layers \[4\] are not among the target's 4"):
        HiddenCapture(target, (0, 4))


def pass_of(target, positions) -> None:
    target(torch.tensor(positions), torch.randn(len(positions), HIDDEN))


def test_rows_the_target_accepted_go_with_the_next_row_until_confirmed():
    target = Target()
    capture = HiddenCapture(target, (1, 3))
    # Step 1: request a prefills 4 tokens (sampled token 4 -> 5 tokens); b's first prefill chunk
    # (3 of its 6 prompt tokens, nothing sampled).
    positions = [0, 1, 2, 3, 0, 1, 2]
    pass_of(target, positions)
    states = HiddenStates()
    states.collect(["a", "b"], [5, 6], *layout([0, 4, 7], positions), capture.rows)
    expected_a = capture.rows(0, 4)
    assert (states.unsent["a"].start, states.unsent["a"].end) == (0, 4)
    assert (states.unsent["b"].start, states.unsent["b"].end) == (0, 3)
    row = Row("a", 0, [1, 2, 3, 4, 5])
    states.attach(row)
    assert row.hidden_start == 0 and states.dtype == "float32"
    torch.testing.assert_close(decode_hidden(row.hidden, states.dtype, 2 * HIDDEN), expected_a)
    states.confirmed("a")
    # Step 2: a verifies its anchor + 2 drafts (positions 4-6), accepts one: 7 tokens; b's last
    # chunk (positions 3-5) samples: 7 tokens.
    positions = [4, 5, 6, 3, 4, 5]
    pass_of(target, positions)
    states.collect(["a", "b"], [7, 7], *layout([0, 3, 6], positions), capture.rows)
    assert (states.unsent["a"].start, states.unsent["a"].end) == (4, 6)  # the rejected row is out
    torch.testing.assert_close(states.unsent["a"].concat(), capture.rows(0, 2))
    row = Row("b", 0, list(range(7)))
    states.attach(row)
    assert row.hidden_start == 0 and len(decode_hidden(row.hidden, "float32", 2 * HIDDEN)) == 6


def test_a_resend_the_proposer_cannot_serve_gives_the_request_up():
    states = HiddenStates()
    states.unsent["a"] = UnsentHidden(5, [torch.zeros(2, HIDDEN)])
    assert states.can_resend("a", 6)  # hidden states from position 5: still here
    assert not states.can_resend("a", 3)  # from 2: confirmed and dropped earlier
    assert "a" in states.given_up and "a" not in states.unsent
    states.unsent["b"] = UnsentHidden(0, [torch.zeros(3, HIDDEN)])  # a prefill, no row sent yet
    states.unsent["c"] = UnsentHidden(0, [torch.zeros(3, HIDDEN)])
    states.keep_only({"c"})  # a and b left the batch
    assert (states.given_up, list(states.unsent)) == (set(), ["c"])


def test_unsent_rows_rerun_from_a_position_replace_what_follows():
    unsent = UnsentHidden(10, [torch.full((3, 2), 1.0)])
    unsent.add(13, torch.full((1, 2), 2.0))
    unsent.add(12, torch.full((2, 2), 3.0))  # positions 12.. computed again
    assert unsent.concat()[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0] and unsent.end == 14
    unsent.add(20, torch.full((1, 2), 4.0))  # not contiguous: starts over
    assert (unsent.start, unsent.end) == (20, 21)


def test_bfloat16_rows_travel_as_their_bits():
    rows = torch.randn(3, 4).to(torch.bfloat16)
    dtype, data = hidden_payload(rows)
    assert dtype == "bfloat16" and len(data) == 3 * 4 * 2
    assert torch.equal(decode_hidden(data, dtype, 4), rows)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_on_model_runner_v1_hidden_states_need_an_eager_engine(enforce_eager):
    """V1's hooks skip compiled graphs, so the proposer refuses a compiled engine when it loads
    (model runner V2 takes the target's own aux hidden states: tests/unit/test_speculator_v2.py)."""
    from moonserve.pipeline.engine.proposer import DraftBook, ProposerStats, ServiceProposer

    proposer = object.__new__(ServiceProposer)
    proposer.hidden_layers, proposer.enforce_eager = (1, 3), enforce_eager
    proposer.book = DraftBook(4, 64, ProposerStats())
    if not enforce_eager:
        with pytest.raises(ValueError, match="enforce_eager: true"):
            proposer.load_model(Target())
        return
    proposer.load_model(Target())
    assert proposer.capture.layer_ids == (1, 3) and proposer.book.hidden is not None
