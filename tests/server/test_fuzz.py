"""Property-based fuzzing of the OpenAI endpoints over real HTTP: no input gives a 5xx.

Bodies are drawn by hypothesis from a mix of well-formed fields and arbitrary JSON in their place,
plus unknown keys and raw bytes. Every response must be a well-formed OpenAI error (4xx) or a valid
completion. The fuzzed Router runs in this process (`RunningServer.router_here`: a Router-only
setting), bound to the session server's LanguageModel, with `max_tokens` capped at 1 so the valid
inputs stay cheap.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL

CHAT_EXAMPLES = 1500
COMPLETION_EXAMPLES = 500
RAW_EXAMPLES = 300
TOKENIZE_EXAMPLES = 200
RESPONSES_EXAMPLES = 500
MESSAGES_EXAMPLES = 500
tried = {"chat": 0, "completions": 0, "raw": 0, "tokenize": 0, "responses": 0, "messages": 0}

json_scalar = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def either(good):
    """Mostly well-formed values, sometimes anything JSON can hold."""
    return st.one_of(good, good, json_value)


text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                   "text": either(st.text(max_size=20))})
schema = either(st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}},
    {"type": "objekt"}, {}]))
tool_name = either(st.sampled_from(["get_weather", "lookup", "bad name!"]))
tool = st.fixed_dictionaries(
    {"type": either(st.just("function")),
     "function": either(st.fixed_dictionaries({"name": tool_name},
                                              optional={"parameters": schema,
                                                        "description": st.text(max_size=10),
                                                        "strict": st.booleans()}))})
tool_call = st.fixed_dictionaries(
    {"id": either(st.sampled_from(["c1", "c2"])), "type": either(st.just("function")),
     "function": either(st.fixed_dictionaries(
         {"name": tool_name, "arguments": either(st.sampled_from(['{"city": "Paris"}', "{}",
                                                                  "[1]", "not json"]))}))})
message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
     "content": either(st.none() | st.text(max_size=40) | st.lists(text_part, max_size=2))},
    optional={"name": json_value, "extra": json_value,
              "tool_calls": either(st.lists(tool_call, max_size=2)),
              "tool_call_id": either(st.sampled_from(["c1", "c3"]))})
tool_fields = {
    "tools": either(st.lists(tool, max_size=3)),
    "tool_choice": either(st.sampled_from(["none", "auto", "required", "any"])
                          | st.fixed_dictionaries({"type": st.just("function"), "function":
                                                   st.fixed_dictionaries({"name": tool_name})})),
    "parallel_tool_calls": either(st.booleans()),
    "response_format": either(st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                               {"type": "xml"}])
                              | st.fixed_dictionaries({"type": st.just("json_schema"),
                                                       "json_schema": st.fixed_dictionaries(
                                                           {"name": st.just("x")},
                                                           optional={"schema": schema,
                                                                     "strict": st.booleans()})})),
    "structured_outputs": either(st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-z]+"},
                                                  {"regex": "(unclosed"}, {"json": {"type": 7}},
                                                  {"choice": []}, {}])),
    "reasoning_effort": either(st.sampled_from(["none", "low", "high", "extreme"])),
}
sampling = {
    "max_tokens": either(st.integers(-3, 2)),
    "temperature": either(st.floats(-1, 3)),
    "top_p": either(st.floats(-0.5, 1.5)),
    "n": either(st.integers(0, 3)),
    "stop": either(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5)),
    "seed": either(st.integers(-(2**64), 2**64)),
    "presence_penalty": either(st.floats(-3, 3)),
    "frequency_penalty": either(st.floats(-3, 3)),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": either(st.booleans() | st.integers(-1, 21)),
    "top_logprobs": either(st.integers(-1, 21)),
    "user": either(st.text(max_size=8)),
    "ignore_eos": either(st.booleans()),
    "top_k": either(st.integers(-2, 50)),
    "min_p": either(st.floats(-0.5, 1.5)),
    "repetition_penalty": either(st.floats(-1, 3)),
    "stop_token_ids": either(st.lists(st.integers(-5, 60000), max_size=3)),
    "min_tokens": either(st.integers(-1, 3)),
    "include_stop_str_in_output": either(st.booleans()),
    "skip_special_tokens": either(st.booleans()),
    "chat_template_kwargs": either(st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "x"]),
                                                   st.booleans(), max_size=2)),
}
chat_body = st.fixed_dictionaries(
    {}, optional={"model": either(st.sampled_from([MODEL, "gpt-4o"])),
                  "messages": either(st.lists(message, max_size=3)),
                  "max_completion_tokens": either(st.integers(-1, 2)), **sampling,
                  **tool_fields, "surprise": json_value})
completion_body = st.fixed_dictionaries(
    {}, optional={"model": either(st.just(MODEL)),
                  "prompt": either(st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=8)),
                  "echo": json_value, "suffix": json_value, **sampling})

tokenize_body = st.fixed_dictionaries(
    {}, optional={"model": either(st.just(MODEL)), "prompt": either(st.text(max_size=40)),
                  "messages": either(st.lists(message, max_size=2)),
                  "tokens": either(st.lists(st.integers(-5, 60000), max_size=8)),
                  "add_generation_prompt": either(st.booleans()),
                  "add_special_tokens": either(st.booleans()),
                  "return_token_strs": either(st.booleans()),
                  "tools": tool_fields["tools"], "surprise": json_value})

# The Responses API (pipeline/api/responses.py): items and parts of each kind, the flat tools.
input_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "input_image", "output_text", "input_file"]),
     "text": either(st.text(max_size=20))}, optional={"image_url": either(st.just("data:x"))})
input_item = st.one_of(
    st.fixed_dictionaries({"role": either(st.sampled_from(["user", "assistant", "system", "tool"])),
                           "content": either(st.text(max_size=30) | st.lists(input_part,
                                                                             max_size=2))},
                          optional={"type": st.just("message"), "id": json_value}),
    st.fixed_dictionaries({"type": st.just("function_call"),
                           "call_id": either(st.sampled_from(["c1", "c2"])), "name": tool_name,
                           "arguments": either(st.sampled_from(['{"city": "Paris"}', "[1]"]))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": either(st.sampled_from(["c1", "c3"])),
                           "output": either(st.text(max_size=10))}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"]),
                           "summary": either(st.just([]))}))
flat_tool = st.fixed_dictionaries(
    {"type": either(st.just("function")), "name": tool_name},
    optional={"parameters": schema, "description": st.text(max_size=10), "strict": st.booleans()})
responses_body = st.fixed_dictionaries(
    {"model": either(st.just(MODEL)),
     "input": either(st.text(max_size=30) | st.lists(input_item, max_size=3))},
    optional={"instructions": either(st.text(max_size=20)),
                  "tools": either(st.lists(flat_tool, max_size=2)),
                  "tool_choice": either(st.sampled_from(["none", "auto", "required", "any"])
                                        | st.fixed_dictionaries({"type": st.just("function"),
                                                                 "name": tool_name})),
                  "parallel_tool_calls": either(st.booleans()),
                  "text": either(st.fixed_dictionaries({"format": either(st.sampled_from(
                      [{"type": "text"}, {"type": "json_object"},
                       {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
                       {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}]))})),
                  "reasoning": either(st.fixed_dictionaries(
                      {"effort": st.sampled_from(["low", "high", "extreme"])})),
                  "max_output_tokens": either(st.integers(-1, 2)),
                  "temperature": sampling["temperature"], "top_p": sampling["top_p"],
                  "stream": either(st.booleans()), "store": either(st.booleans()),
                  "previous_response_id": either(st.just("resp_missing")),
                  "include": either(st.lists(st.text(max_size=8), max_size=1)),
                  "truncation": either(st.sampled_from(["disabled", "auto"])),
                  "background": json_value, "surprise": json_value})

# Anthropic's Messages API (pipeline/api/messages.py): blocks of each kind in either role.
block = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "thinking", "document"]),
                           "text": either(st.text(max_size=20))}),
    st.fixed_dictionaries({"type": st.just("image"), "source": either(st.fixed_dictionaries(
        {"type": st.sampled_from(["base64", "url"]),
         "media_type": st.sampled_from(["image/png", "image/bmp"]),
         "data": st.sampled_from(["AAAA", "not base64"])}))}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", "t2"]),
                           "name": tool_name, "input": either(st.just({"city": "Paris"}))}),
    st.fixed_dictionaries({"type": st.just("tool_result"),
                           "tool_use_id": st.sampled_from(["t1", "t3"])},
                          optional={"content": either(st.text(max_size=10)),
                                    "is_error": st.booleans()}))
anthropic_message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["user", "assistant", "system"])),
     "content": either(st.text(max_size=30) | st.lists(block, max_size=3))})
anthropic_tool = st.fixed_dictionaries({"name": tool_name}, optional={
    "input_schema": schema, "description": st.text(max_size=10)})
messages_body = st.fixed_dictionaries(
    {"model": either(st.just(MODEL)),
     "messages": either(st.lists(anthropic_message, max_size=3)),
     "max_tokens": either(st.integers(-1, 2))},
    optional={"system": either(st.text(max_size=20)),
              "tools": either(st.lists(anthropic_tool, max_size=2)),
              "tool_choice": either(st.fixed_dictionaries(
                  {"type": st.sampled_from(["auto", "any", "tool", "none", "all"])},
                  optional={"name": tool_name, "disable_parallel_tool_use": st.booleans()})),
              "stop_sequences": either(st.lists(st.text(max_size=3), max_size=5)),
              "thinking": either(st.fixed_dictionaries(
                  {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                  optional={"budget_tokens": st.integers(0, 5000)})),
              "output_config": either(st.fixed_dictionaries({}, optional={
                  "effort": st.sampled_from(["low", "max", "huge"]),
                  "format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                   "schema": schema})})),
              "temperature": either(st.floats(-1, 2)), "top_k": either(st.integers(-2, 5)),
              "stream": either(st.booleans()), "metadata": json_value,
              "speed": json_value, "surprise": json_value})


@pytest.fixture(scope="module")
def fuzz_url(server):
    with server.router_here(limits={"max_tokens": 1, "default_max_tokens": 1}) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        yield http


def check_response(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if stream:
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            # The one error a 200 stream may end with: a forced tool call that max_tokens (1 in
            # this app) or a stop sequence cut short; it names the field, like a 400.
            error = json.loads(event.removeprefix("data: ")).get("error")
            assert error is None or error["code"] == "tool_call_incomplete", event
        return
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert body["usage"]["completion_tokens"] <= len(body["choices"])


def typed_events(text: str) -> list[dict]:
    """The data of each `event:`/`data:` pair of a Responses or Messages stream."""
    return [json.loads(chunk.split("\n")[1].removeprefix("data: "))
            for chunk in text.split("\n\n") if chunk]


FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                            HealthCheck.data_too_large])


@settings(max_examples=CHAT_EXAMPLES, **FUZZ_SETTINGS)
@given(body=chat_body)
def test_fuzz_chat_completions(fuzz_url, body):
    tried["chat"] += 1
    check_response(fuzz_url.post("/v1/chat/completions", json=body), body.get("stream") is True)


@settings(max_examples=COMPLETION_EXAMPLES, **FUZZ_SETTINGS)
@given(body=completion_body)
def test_fuzz_completions(fuzz_url, body):
    tried["completions"] += 1
    check_response(fuzz_url.post("/v1/completions", json=body), body.get("stream") is True)


@settings(max_examples=TOKENIZE_EXAMPLES, **FUZZ_SETTINGS)
@given(body=tokenize_body, path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_fuzz_tokenize(fuzz_url, body, path):
    tried["tokenize"] += 1
    r = fuzz_url.post(path, json=body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=RESPONSES_EXAMPLES, **FUZZ_SETTINGS)
@given(body=responses_body)
def test_fuzz_responses(fuzz_url, body):
    tried["responses"] += 1
    r = fuzz_url.post("/v1/responses", json=body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if body.get("stream") is not True:
        assert r.json()["status"] in ("completed", "incomplete")
        return
    events = typed_events(r.text)
    assert events[-1]["type"] in ("response.completed", "response.incomplete",
                                  "response.failed"), events[-1]
    for event in events:
        # As in chat streams: only a forced call that max_output_tokens cut short.
        assert event["type"] != "error" or event["code"] == "tool_call_incomplete", event


@settings(max_examples=MESSAGES_EXAMPLES, **FUZZ_SETTINGS)
@given(body=messages_body)
def test_fuzz_messages(fuzz_url, body):
    tried["messages"] += 1
    r = fuzz_url.post("/v1/messages", json=body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["message"]
        return
    if body.get("stream") is not True:
        assert r.json()["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
        return
    events = typed_events(r.text)
    assert events[-1]["type"] in ("message_stop", "error"), events[-1]
    for event in events:
        assert event["type"] != "error" or "max_tokens" in event["error"]["message"], event


@settings(max_examples=RAW_EXAMPLES, **FUZZ_SETTINGS)
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzz_raw_bytes(fuzz_url, raw):
    tried["raw"] += 1
    r = fuzz_url.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    check_response(r, stream=False)


def test_fuzz_counts(fuzz_url):
    """Runs after the fuzz tests (file order): reports how many inputs were tried."""
    total = sum(tried.values())
    if total == 0:
        pytest.skip("the fuzz tests were deselected")
    print(f"\nfuzzed inputs tried: {tried} total={total}")
    assert total >= CHAT_EXAMPLES + COMPLETION_EXAMPLES + RAW_EXAMPLES + TOKENIZE_EXAMPLES + \
        RESPONSES_EXAMPLES + MESSAGES_EXAMPLES
