"""The Responses API without a server: requests validated and turned into chat requests (400s
name the Responses fields), answers parsed by vLLM's parsers turned into Responses and stream
events that the `openai` package's own models accept, and the SQLite store every Router replica
of a node shares."""

from __future__ import annotations

import json
import time

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from moonserve.pipeline.api.body import parse_body
from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.api.protocol import Completion, GenerationDelta
from moonserve.pipeline.api.response_store import open_store
from moonserve.pipeline.api.responses import ResponsesRequest, ResponsesStream, ResponsesTurn
from moonserve.pipeline.api.streaming import PlainChoice
from tests.unit.test_chat_parsing import (  # noqa: F401 - fixtures
    THOUGHT,
    TWO_CALLS,
    parsing,
    stream_deltas,
    thinking_parsing,
    tokenizer,
    tools_prompt,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city"]}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def turn(body: dict, history: list[dict] | None = None) -> ResponsesTurn:
    request = parse_body(ResponsesRequest, json.dumps({"model": "m", **body}).encode())
    return ResponsesTurn(request, history or [], "m")


def refusal(body: dict, history: list[dict] | None = None) -> APIError:
    with pytest.raises(APIError) as caught:
        turn(body, history).chat_request()
    assert caught.value.status == 400
    return caught.value


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Oslo"}'}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "bogus": 1}, "bogus"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_txt", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "nope", "output": "r"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": "x"}, {**CALL, "arguments": "[1]"}]},
     "input[1].arguments"),
    ({"input": "hi", "tools": [{**TIME, "parameters": {"type": "objectx"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "tools": [TIME, TIME]}, "tools[1].name"),
    ({"input": "hi", "tools": [TIME], "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                                         "schema": {"type": 5}}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
])
def test_bad_requests_name_the_responses_field(body, param):
    assert refusal(body).param == param


def test_a_turn_is_its_instructions_history_and_input_as_chat_messages():
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    image = "data:image/png;base64,AAAA"
    chat = turn({"instructions": "Be brief.", "input": [
        {"type": "function_call_output", "call_id": "call_0", "output": "rain"},
        {"role": "user", "content": [{"type": "input_text", "text": "And here?"},
                                     {"type": "input_image", "image_url": image}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "look it up"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []}]},
        CALL, {**CALL, "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
    ], "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_time"},
        "max_output_tokens": 7, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                            "strict": True}}}, history).chat_request()
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool"]
    assert chat.messages[4].image_urls() == [(1, image)]
    merged = chat.messages[5]
    assert merged.content == "Checking." and merged.reasoning_content == "look it up"
    assert [c.id for c in merged.tool_calls] == ["call_1", "call_2"]
    assert chat.tool_choice.function.name == "get_time"
    assert chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.max_completion_tokens == 7 and chat.reasoning_effort == "low"
    assert chat.response_format.json_schema.strict is True


def whole(parsing, tokenizer, prompt_ids, body: dict, text: str, finish="stop") -> dict:
    t = turn(body)
    plan = parsing.plan(t.chat_request())
    ids = tokenizer.encode(text, add_special_tokens=False)
    completion = Completion()
    completion.add(GenerationDelta(text, len(ids), 9, finish, token_ids=ids,
                                   num_cached_tokens=4))
    return t.full(plan.choice_parser(prompt_ids), completion)


@pytest.fixture(scope="module")
def prompt_ids(tools_prompt):
    return tools_prompt.tokenizer.encode("prompt")


def test_a_whole_answer_with_calls_is_a_response_openai_reads(parsing, tokenizer, prompt_ids):
    body = whole(parsing, tokenizer, prompt_ids, {"input": "Weather?", "tools": [WEATHER, TIME]},
                 TWO_CALLS)
    response = Response.model_validate(body)
    assert response.status == "completed"
    assert [(o.type, o.name, json.loads(o.arguments)) for o in response.output] == [
        ("function_call", "get_weather", {"city": "Zürich", "unit": "C"}),
        ("function_call", "get_time", {"tz": "CET"})]
    assert all(o.call_id for o in response.output)
    assert response.usage.input_tokens == 9
    assert response.usage.input_tokens_details.cached_tokens == 4
    assert response.tools[0].name == "get_weather"


def test_an_answer_cut_by_max_output_tokens_is_incomplete(parsing, tokenizer, prompt_ids):
    body = whole(parsing, tokenizer, prompt_ids, {"input": "Hi", "max_output_tokens": 3},
                 "Hello to", finish="length")
    response = Response.model_validate(body)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hello to"


def stream(t: ResponsesTurn, parser, tokenizer, text: str, merge: int) -> list:
    encoder = ResponsesStream(t, parser)
    out = encoder.opening()
    deltas = stream_deltas(tokenizer, text, merge)
    for i, (piece, ids) in enumerate(deltas):
        out += encoder.encode(GenerationDelta(piece, len(ids), 9,
                                              "stop" if i == len(deltas) - 1 else None,
                                              token_ids=ids))
    out += encoder.closing()
    raw = [chunk for chunk in out.decode().split("\n\n") if chunk]
    events = []
    for chunk in raw:
        kind, data = chunk.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response == Response.model_validate(encoder.response)
    return events


@pytest.mark.parametrize("merge", [1, 4, 1000])
def test_streamed_calls_are_the_whole_answers_items(parsing, tokenizer, prompt_ids, merge):
    body = {"input": "Weather?", "tools": [WEATHER, TIME], "stream": True}
    t = turn(body)
    events = stream(t, parsing.plan(t.chat_request()).choice_parser(prompt_ids), tokenizer,
                    TWO_CALLS, merge)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    streamed = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            streamed[e.output_index] = streamed.get(e.output_index, "") + e.delta
    assert [json.loads(streamed[i]) for i in range(2)] == \
        [json.loads(o.arguments) for o in final.output]
    expected = whole(parsing, tokenizer, prompt_ids, body, TWO_CALLS)["output"]
    assert [(o.name, o.arguments) for o in final.output] == \
        [(o["name"], o["arguments"]) for o in expected]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done == final.output


def test_streamed_thinking_is_a_reasoning_item_before_the_message(thinking_parsing):
    tokenizer = thinking_parsing.tokenizer
    t = turn({"input": "Hi", "stream": True})
    plan = thinking_parsing.plan(t.chat_request())
    events = stream(t, plan.choice_parser([1, 2]), tokenizer, THOUGHT, 1)
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "The user greets me; greet back."
    assert final.output_text == "Hello there!"
    assert "response.reasoning_text.delta" in [e.type for e in events]


def test_a_plain_stream_equals_its_response():
    t = turn({"input": "Hi", "stream": True})
    encoder = ResponsesStream(t, PlainChoice())
    out = encoder.opening() + encoder.encode(GenerationDelta("Hel", 1, 3)) + \
        encoder.encode(GenerationDelta("lo", 1, 3, "stop")) + encoder.closing()
    assert b"event: response.output_text.delta" in out
    assert Response.model_validate(encoder.response).output_text == "Hello"
    assert t.turn_messages(encoder.response) == [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello"}]


def test_an_error_mid_stream_ends_it_failed():
    t = turn({"input": "Hi", "stream": True})
    encoder = ResponsesStream(t, PlainChoice())
    out = encoder.opening() + encoder.error(APIError(500, "boom", code="x")) + \
        encoder.closing(with_usage=False)
    kinds = [json.loads(c.split("\n")[1][6:])["type"] for c in out.decode().split("\n\n") if c]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]
    assert encoder.response is None  # nothing to store


# ---- the store: SQLite (one node) and Redis (a cluster), the same behaviour -------------------

@pytest.fixture(params=["sqlite", "redis"])
def database(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "r.sqlite3")
    return request.getfixturevalue("redis_url")


def stored(store, owner: str, text: str, previous: str | None = None) -> str:
    t = turn({"input": text, **({"previous_response_id": previous} if previous else {})})
    response = t.response([{"id": "msg_1", "type": "message", "role": "assistant",
                            "status": "completed", "content": [{"type": "output_text",
                                                                "text": text.upper()}]}],
                          "completed", None)
    store.put(owner, response, t.items, t.turn_messages(response))
    return response["id"]


def test_a_chain_of_turns_is_one_history_for_its_key_only(database):
    one, other = open_store(database, 3600), open_store(database, 3600)  # two Router replicas
    first = stored(one, "key-a", "a")
    second = stored(other, "key-a", "b", previous=first)
    messages, session = one.history("key-a", second)
    assert [m["content"] for m in messages] == ["a", "A", "b", "B"] and session == first
    # Every turn of the session has the first turn's id as its routing key.
    assert ResponsesTurn(turn({"input": "c"}).body, messages, "m", session) \
        .chat_request().prompt_cache_key == first
    assert other.get("key-a", first)["id"] == first
    for call in (lambda: one.get("key-b", first), lambda: one.history("key-b", second),
                 lambda: one.delete("key-b", first)):
        with pytest.raises(APIError) as caught:
            call()
        assert caught.value.status == 404
    one.delete("key-a", first)
    with pytest.raises(APIError) as caught:
        other.history("key-a", second)  # its chain is broken now
    assert caught.value.param == "previous_response_id"


def test_a_turn_past_its_retention_is_gone(database):
    store = open_store(database, retention_s=0.2)
    old = stored(store, "", "a")
    time.sleep(0.3)
    new = stored(store, "", "b")
    with pytest.raises(APIError):
        store.get("", old)
    assert store.get("", new)["id"] == new
    assert store.input_items("", new)[0]["content"] == "b"


def test_input_items_page_as_openai_pages_them():
    from moonserve.deployments.router import page

    items = [{"id": f"i{k}"} for k in range(5)]
    first = page(items, {"limit": "2"})
    assert [i["id"] for i in first["data"]] == ["i4", "i3"] and first["has_more"]
    rest = page(items, {"limit": "2", "after": first["last_id"]})
    assert [i["id"] for i in rest["data"]] == ["i2", "i1"]
    assert [i["id"] for i in page(items, {"order": "asc"})["data"]] == [f"i{k}" for k in range(5)]
    for query, param in (({"limit": "0"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "x"}, "after")):
        with pytest.raises(APIError) as caught:
            page(items, query)
        assert caught.value.param == param


@pytest.mark.parametrize("database", ["redis", "sqlite"])
def test_a_store_that_cannot_be_reached_is_a_503_to_retry(database, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the database's folder would be
    store = open_store(f"redis://127.0.0.1:{port}/0" if database == "redis" else
                       str(blocked / "r.sqlite3"), 60)
    for call in (lambda: stored(store, "", "a"), lambda: store.get("", "resp_x")):
        with pytest.raises(APIError) as caught:
            call()
        error = caught.value
        assert (error.status, error.code, error.headers) == \
            (503, "store_unavailable", {"Retry-After": "1"})


def test_the_database_is_a_path_or_a_redis_url():
    from pydantic import ValidationError

    from moonserve.pipeline.config import ResponsesConfig

    for ok in ("~/r.sqlite3", "/var/lib/r.db", "redis://h:6379/0", "rediss://h:6380/1"):
        assert ResponsesConfig(database=ok).database == ok
    with pytest.raises(ValidationError, match="a SQLite file path or a redis://"):
        ResponsesConfig(database="postgres://h/db")
