"""Property-based fuzz of the agentic surface against the live app (issue 37): well-formed but
awkward requests (function tools with varied schemas, every `tool_choice`, `parallel_tool_calls`,
`n`, `logprobs`/`top_logprobs`, `response_format` with random JSON Schemas, `stop`, `stream`,
tool histories with matching and mismatched ids, images), each asserted to end as designed:

- never a 5xx; a 4xx is an OpenAI error, and a refused schema names its field and keyword;
- the body is strict JSON (no NaN or Infinity) and every logprob a finite number;
- a stream ends in `[DONE]`, after an error event only where the design says so (a forced call
  cut short: `tool_call_incomplete`);
- a 200 with `tool_choice` required or named carries a call in every choice, and every complete
  call's arguments validate against its tool's schema;
- a finished answer under a `json_schema` response_format validates against it (issue 36).

`MOONSERVE_AGENTIC_EXAMPLES` sets how many requests are drawn (default 40, about two minutes);
the outcomes are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import FormatChecker
from jsonschema.validators import Draft202012Validator, validator_for

from moonserve.pipeline.bench.corpus import data_url
from tests.conftest import MODEL
from tests.payloads import png
from tests.strategies import random_schema

EXAMPLES = int(os.environ.get("MOONSERVE_AGENTIC_EXAMPLES", "40"))
outcomes: Counter = Counter()

PARAMETERS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
     "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["n"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "maxLength": 6}}}},
    {"type": "object", "properties": {}},
]
IMAGE = {"type": "image_url", "image_url": {"url": data_url(png((32, 24), (0, 120, 200)))}}


@st.composite
def tools(draw) -> list[dict]:
    count = draw(st.integers(1, 3))
    schemas = draw(st.lists(st.sampled_from(PARAMETERS) | random_schema, min_size=count,
                            max_size=count))
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "a tool",
                                              "parameters": schema}}
            for i, schema in enumerate(schemas)]


@st.composite
def history(draw, tool_list: list[dict]) -> list[dict]:
    """A user turn; sometimes an earlier call and its result (ids matching, or not)."""
    content = draw(st.sampled_from(["What is the weather in Paris?", "Tag this: blue, sea.",
                                    "Count to three."]))
    user = {"role": "user", "content": [IMAGE, {"type": "text", "text": content}]
            if draw(st.booleans()) and draw(st.booleans()) else content}
    if not tool_list or not draw(st.booleans()):
        return [user]
    name = tool_list[0]["function"]["name"]
    answered = draw(st.sampled_from(["call_1", "call_1", "call_2"]))
    return [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": answered, "content": "done"}, user]


@st.composite
def agentic_request(draw) -> dict:
    tool_list = draw(st.one_of(st.just([]), tools()))
    body = {"model": MODEL, "messages": draw(history(tool_list)),
            "max_tokens": draw(st.integers(4, 48))}
    if tool_list:
        body["tools"] = tool_list
        choice = draw(st.sampled_from(["none", "auto", "required", "named", None]))
        if choice == "named":
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": draw(st.sampled_from(
                                       [t["function"]["name"] for t in tool_list]))}}
        elif choice is not None:
            body["tool_choice"] = choice
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
    n = draw(st.sampled_from([1, 1, 2]))
    body["temperature"] = draw(st.sampled_from([0.0, 0.7])) if n == 1 else 0.8
    body["n"] = n
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    fmt = draw(st.sampled_from([None, None, "json_object", "json_schema"]))
    if fmt == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": draw(random_schema), "strict": draw(st.booleans())}}
    if draw(st.booleans()):
        body["stop"] = draw(st.sampled_from(["\n\n", ["}"], ["</tool_call>", "."]]))
    body["stream"] = draw(st.booleans())
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body


def strict_json(text: str):
    """JSON as RFC 8259 has it: NaN and Infinity refused."""
    def refuse(constant):
        raise AssertionError(f"non-finite number {constant} in {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def forced(body: dict) -> bool:
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def schema_validator(schema: dict):
    return validator_for(schema, default=Draft202012Validator)(schema,
                                                               format_checker=FormatChecker())


def check_calls(body: dict, calls: list[dict]) -> None:
    """Every complete call names a tool and its arguments validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body.get("tools", ())}
    for call in calls:
        assert call["name"] in schemas, call
        arguments = strict_json(call["arguments"])
        errors = [e.message for e in schema_validator(schemas[call["name"]]).iter_errors(arguments)]
        assert not errors, f"call {call} breaks {schemas[call['name']]}: {errors}"


def check_logprobs(logprobs) -> None:
    for entry in (logprobs or {}).get("content") or ():
        assert math.isfinite(entry["logprob"]), entry
        assert all(math.isfinite(top["logprob"]) for top in entry["top_logprobs"]), entry


def check_content(body: dict, content: str | None, calls: list, finish: str) -> None:
    fmt = body.get("response_format") or {}
    if fmt.get("type") != "json_schema" or calls or finish != "stop" or "stop" in body:
        return  # a stop sequence may end an answer early by design
    answer = json.loads(content, strict=False)  # docs/tools.md: xgrammar's control characters
    schema = fmt["json_schema"]["schema"]
    errors = [e.message for e in schema_validator(schema).iter_errors(answer)]
    assert not errors, f"{content!r} breaks {schema}: {errors}"


def check_refusal(body: dict, r: httpx.Response) -> str:
    error = strict_json(r.text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if error["code"] == "unenforceable_schema":
        assert error["param"] and "keyword" in error["message"], error
    return f"{r.status_code} {error['code']}"


def check_whole(body: dict, reply: dict) -> str:
    for choice in reply["choices"]:
        message, finish = choice["message"], choice["finish_reason"]
        calls = [c["function"] for c in message.get("tool_calls") or ()]
        if forced(body):
            assert calls, f"tool_choice {body['tool_choice']} answered without a call: {choice}"
        check_calls(body, calls)
        check_logprobs(choice.get("logprobs"))
        check_content(body, message.get("content"), calls, finish)
    return "200 calls" if any(c["message"].get("tool_calls") for c in reply["choices"]) else "200"


def check_stream(body: dict, text: str) -> str:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    choices: dict[int, dict] = {}
    for event in events[:-1]:
        payload = strict_json(event)
        if "error" in payload:
            assert payload["error"]["code"] == "tool_call_incomplete", payload
            assert event is events[-2], "an error event is the stream's last"
            return "stream tool_call_incomplete"
        for choice in payload["choices"]:
            state = choices.setdefault(choice["index"], {"content": "", "calls": {}, "finish": None})
            delta = choice["delta"]
            state["content"] += delta.get("content") or ""
            for piece in delta.get("tool_calls") or ():
                call = state["calls"].setdefault(piece["index"], {"name": None, "arguments": ""})
                call["name"] = call["name"] or piece.get("function", {}).get("name")
                call["arguments"] += piece.get("function", {}).get("arguments") or ""
            check_logprobs(choice.get("logprobs"))
            state["finish"] = choice["finish_reason"] or state["finish"]
    assert sorted(choices) == list(range(body["n"])), choices
    for state in choices.values():
        calls = list(state["calls"].values())
        if forced(body):
            assert calls, f"tool_choice {body['tool_choice']} streamed without a call"
        check_calls(body, calls)
        check_content(body, state["content"], calls, state["finish"])
    return "stream calls" if any(s["calls"] for s in choices.values()) else "stream"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(body=agentic_request())
def test_agentic_requests_end_as_designed(http, body):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}\nrequest: {json.dumps(body)}"
    if r.status_code != 200:
        outcomes[check_refusal(body, r)] += 1
    elif body["stream"]:
        outcomes[check_stream(body, r.text)] += 1
    else:
        outcomes[check_whole(body, strict_json(r.text))] += 1


def test_agentic_outcomes():
    """Runs after the fuzz (file order): prints what the drawn requests came to."""
    if not outcomes:
        pytest.skip("the agentic fuzz was deselected")
    print(f"\nagentic fuzz ({EXAMPLES} requests): {dict(outcomes)}")
    assert sum(outcomes.values()) == EXAMPLES
    assert any(k.startswith("200") or k.startswith("stream") for k in outcomes)
