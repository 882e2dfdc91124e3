"""The session server of tests/smollm2: `configs/local.yaml` as shipped (SmolLM2-135M-Instruct),
for the tests that need the model's real text: equivalence with transformers, real answers,
logprobs, sampled distributions, real tool calls. Each asks for few tokens (the model makes
~20-40 a second here); every other live test runs on the tiny model in tests/server."""

from __future__ import annotations

import os

import openai
import pytest

from moonserve.pipeline.config import DEFAULT_CONFIG
from tests.serving import RunningServer, session_server, settled

# Beside tests/server's ports: both directories' servers run at once under pytest-xdist.
HTTP_PORT = int(os.environ.get("MOONSERVE_TEST_PORT", "8123")) + 1


# What the directory's tests may have SmolLM2 generate, in completion tokens (the Router's
# counter, read before the server stops; 2,703 when it was set): the one group on the real model
# stays small. A test that needs more text than its share belongs on the tiny model in
# tests/server.
TOKEN_BUDGET = 4_000


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> RunningServer:
    servers = session_server(tmp_path_factory.mktemp("smollm2"), DEFAULT_CONFIG, HTTP_PORT)
    running = next(servers)
    yield running
    try:
        generated = settled(running.metrics_url, "ray_moonserve_completion_tokens_total")
    finally:
        next(servers, None)  # stops the server
    print(f"\ntests/smollm2: SmolLM2 generated {generated:.0f} completion tokens")
    assert generated <= TOKEN_BUDGET, \
        f"tests/smollm2 generated {generated:.0f} completion tokens, over its {TOKEN_BUDGET}"


@pytest.fixture(scope="package")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="package")
def reference_model():
    """transformers' model and tokenizer on the same checkpoint, float32, for equivalence tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    path = prepare_language_model(progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))
