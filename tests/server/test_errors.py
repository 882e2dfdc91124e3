"""Bad input gets a 4xx in OpenAI form naming the field, over real HTTP; never a 5xx."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


CHAT_CASES = [
    # (body, status, param, words the message must contain)
    (chat(temperature="hot"), 400, "temperature", "valid number"),
    (chat(temperature=3), 400, "temperature", "less than or equal to 2"),
    (chat(max_tokens=-5), 400, "max_tokens", "greater than or equal to 1"),
    (chat(max_tokens=True), 400, "max_tokens", "valid integer"),
    (chat(top_p=0), 400, "top_p", "greater than 0"),
    (chat(n=0), 400, "n", "greater than or equal to 1"),
    (chat(n=129), 400, "n", "less than or equal to 128"),
    (chat(n=17), 400, "n", "limit of 16"),
    (chat(n=2, temperature=0), 400, "n", "greedy sampling"),
    (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    (chat(functions=[{"name": "f"}]), 400, "functions", "not supported"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     400, "tools[0].function.parameters", "not a valid JSON Schema"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice.function.name", "no tool is named 'g'"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}]),
     400, "tools[0].function.parameters", "multipleOf"),
    ({"model": MODEL, "messages": [*USER, {"role": "tool", "tool_call_id": "c9", "content": "x"}]},
     400, "messages[1].tool_call_id", "matches no tool call"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": 5}}}), 400, "response_format.json_schema.schema", "not a valid JSON Schema"),
    (chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", "less than or equal to 20"),
    (chat(logprobs=1), 400, "logprobs", "valid boolean"),
    (chat(response_format={"type": "xml"}), 400, "response_format", "tag"),
    (chat(frobnicate=1), 400, "frobnicate", "Unrecognized request argument"),
    (chat(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
    ({"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    ({"model": MODEL}, 400, "messages", "required"),
    ({"messages": USER}, 400, "model", "required"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "user"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "messages[0].content[0].text", "valid string"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     400, "messages[0].content[0]", "tag"),
    (chat(max_tokens=10**9), 400, "max_tokens", "maximum context length"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]},
     400, "messages", "maximum context length"),
    (chat(model="gpt-17"), 404, "model", "does not exist"),
    (chat(seed=2**70), 400, "seed", "less than"),
]


@pytest.mark.parametrize("body,status,param,words", CHAT_CASES)
def test_chat_rejections_name_the_field(server, body, status, param, words):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert param.split("[")[0] in error["message"] and words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw,words", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "object"),
    (b"", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_malformed_bodies_are_400(server, raw, words):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


COMPLETION_CASES = [
    ({"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "prompt[2]", "outside the vocabulary"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "at least 1"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", "not supported"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt[0]", "valid integer"),
    ({"model": MODEL, "prompt": "x " * 6000}, 400, "prompt", "maximum context length"),
]


@pytest.mark.parametrize("body,status,param,words", COMPLETION_CASES)
def test_completion_rejections_name_the_field(server, body, status, param, words):
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def body_limit() -> int:
    from moonserve.pipeline.config import load_app_config
    from tests.conftest import LOCAL_CONFIG

    return load_app_config(LOCAL_CONFIG).router.limits.max_request_bytes


def test_body_over_limit_is_413(server):
    body = chat(messages=[{"role": "user", "content": "x" * (body_limit() + (1 << 20))}])
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]


def test_chunked_body_over_limit_is_413(server):
    def chunks():
        for _ in range(body_limit() // 65536 + 8):
            yield b"x" * 65536

    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_unknown_route_is_openai_404(server):
    r = httpx.get(f"{server.base_url}/v1/engines", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
