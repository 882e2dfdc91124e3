"""The session server of tests/server: `configs/local.yaml` on the tiny model (tests/serving.py),
started once for the directory. Tests here talk to it over real HTTP with the real `openai`
client; tests/conftest.py marks every test that uses the `server` fixture `server`."""

from __future__ import annotations

import os

import openai
import pytest

from tests.serving import RunningServer, session_server, tiny_model_config

# Ports away from the defaults, so a developer's own `moonserve serve` does not collide.
HTTP_PORT = int(os.environ.get("MOONSERVE_TEST_PORT", "8123"))


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> RunningServer:
    root = tmp_path_factory.mktemp("server")
    yield from session_server(root, tiny_model_config(root / "tiny.yaml"), HTTP_PORT)


@pytest.fixture(scope="package")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="package")
def tokenizer(server):
    """The served model's tokenizer (SmolLM2's, which the tiny model keeps)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.args()["language_model"]["engine"]["model"])
