"""`draft.drafter: dspark_context` in a running app: the target's hidden states reach the drafter.

The app is `configs/local.yaml` without vision, with the DraftService drafting from a K3 DSpark
checkpoint sized to the embedded target. The checkpoint has random weights, is written here, and
reads target layers 0, 14 and 29. The engine is this module's own and is stopped before the
session server's starts (tests/engines runs before tests/server).

- Greedy output with the hidden-state drafter equals output with the `none` drafter, and the
  engine verified drafts, so the drafter really ran.
- One request alone: the service received a hidden-state row for every token of the request but
  its last (that one is the anchor of the final step): prompt + completion - 1.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from safetensors.torch import save_file

from moonserve.pipeline.bench.corpus import copy_prompts
from moonserve.pipeline.models.dspark import DSparkConfig, DSparkModel
from tests.conftest import MODEL
from tests.engines.own_app import local_args, running_app, serve_calls_in_child

HTTP_PORT = 8131
TOKENS = 24
TARGET = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}


def write_drafter(directory) -> None:
    """config.json (vLLM's K3DSparkConfig fields) and random weights without the target's
    embedding and LM head, which the service shares from the target."""
    config = DSparkConfig(
        hidden_size=TARGET["hidden_size"], vocab_size=TARGET["vocab_size"], num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=512, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, markov_rank=16,
        mask_token_id=0, target_layer_ids=(0, 14, 29), target_hidden_size=TARGET["hidden_size"],
        num_target_layers=3, shares_target_embedding=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = DSparkModel(config, tie_word_embeddings=False, conditioned=True)
    tensors = {name: (torch.ones_like(p) if name.endswith("norm.weight") else
                      0.02 * torch.randn_like(p)).contiguous()
               for name, p in model.state_dict().items()
               if name not in ("embed_tokens.weight", "lm_head.weight")}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {**config.to_dict(), "model_type": "k3_dspark", "dspark_noise_token_id": 0}))
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-context")
    write_drafter(root / "drafter")
    data, args = local_args()
    args["vision"] = None
    # Adaptive depth off: a paused request's rows would wait out its pause (StepReply.quiet), and
    # those of its last steps would never be sent, so the row count below would not be exact.
    args["draft"] = {**args.get("draft", {}), "mode": "service", "drafter": "dspark_context",
                     "model": str(root / "drafter"), "deadline_ms": 2000.0,
                     "adaptive": {"enabled": False}}
    with running_app(root, data, HTTP_PORT) as process:
        yield process


@pytest.fixture(scope="module")
def serve_calls(app):
    with serve_calls_in_child() as call:
        yield call


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none")


def greedy(client, prompt: str):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS,
        temperature=0)


def test_greedy_output_equals_output_without_drafts(client, serve_calls):
    prompts = copy_prompts(4)
    serve_calls("DraftService", "set_drafter", "none")
    try:
        without = [greedy(client, p).choices[0].message.content for p in prompts]
    finally:
        serve_calls("DraftService", "set_drafter", "dspark_context")
    before = serve_calls("LanguageModel", "stats")["num_draft_tokens"]
    with_drafts = [greedy(client, p).choices[0].message.content for p in prompts]
    assert with_drafts == without
    assert serve_calls("LanguageModel", "stats")["num_draft_tokens"] > before, \
        "no drafts were verified"


def test_the_service_gets_a_hidden_state_row_for_every_token_but_the_anchor(client, serve_calls):
    before = serve_calls("DraftService", "stats")
    assert before["drafter"] == "dspark_context"
    usage = greedy(client, copy_prompts(5)[-1]).usage
    after = serve_calls("DraftService", "stats")
    assert after["num_context_rows"] - before["num_context_rows"] == \
        usage.prompt_tokens + usage.completion_tokens - 1
