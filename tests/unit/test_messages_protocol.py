"""Anthropic's Messages API without a server: requests validated and turned into chat requests
(400s name Anthropic's fields), answers parsed by vLLM's parsers turned into Messages and stream
events that the `anthropic` package's own models accept, errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from moonserve.pipeline.api.body import parse_body
from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.api.messages import MessagesRequest, MessagesTurn, anthropic_error
from moonserve.pipeline.api.protocol import Completion, GenerationDelta
from tests.unit.test_chat_parsing import (  # noqa: F401 - fixtures
    THOUGHT,
    TWO_CALLS,
    parsing,
    stream_deltas,
    thinking_parsing,
    tokenizer,
    tools_prompt,
)

WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["C", "F"]}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object",
                                             "properties": {"tz": {"type": "string"}}}}
EVENTS = TypeAdapter(RawMessageStreamEvent)
ASK = [{"role": "user", "content": "Weather?"}]


def turn(body: dict) -> MessagesTurn:
    request = parse_body(MessagesRequest, json.dumps(
        {"model": "m", "max_tokens": 64, **body}).encode())
    return MessagesTurn(request, "m")


def refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        turn(body).chat_request()
    assert caught.value.status == 400
    return caught.value


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": ASK, "speed": "fast"}, "speed"),
    ({"messages": ASK, "bogus": 1}, "bogus"),
    ({"messages": [{"role": "user", "content": [USE]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": "toolu_9"}]}]},
     "messages[0].content[0].tool_call_id"),
    ({"messages": ASK, "tools": [{**TIME, "input_schema": {"type": "objectx"}}]},
     "tools[0].input_schema"),
    ({"messages": ASK, "tools": [TIME], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": ASK, "tools": [TIME], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice.name"),
    ({"messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 10}},
     "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/bmp", "data": "AA"}}]}]},
     "messages[0].content[0].source.media_type"),
])
def test_bad_requests_name_the_messages_field(body, param):
    assert refusal(body).param == param


def test_errors_take_anthropics_shape():
    body = anthropic_error(APIError(429, "slow down", code="x"))
    assert body == {"type": "error", "error": {"type": "rate_limit_error",
                                               "message": "slow down"}}
    assert anthropic_error(APIError(503, "busy"))["error"]["type"] == "overloaded_error"


def test_a_conversation_with_tool_use_and_results_becomes_chat_messages():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    chat = turn({"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather here?"}, image]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "look up",
                                           "signature": ""},
                                          {"type": "text", "text": "Checking."}, USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "rain"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ], "tools": [WEATHER, TIME], "tool_choice": {"type": "any",
                                                 "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "u1"}}).chat_request()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[1].image_urls() == [(1, "data:image/png;base64,AAAA")]
    assistant = chat.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning_content == "look up"
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "rain"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.stop == ["END"] and chat.user == "u1" and chat.reasoning_effort == "high"


@pytest.fixture(scope="module")
def prompt_ids(tools_prompt):
    return tools_prompt.tokenizer.encode("prompt")


def whole(parsing, tokenizer, prompt_ids, body: dict, text: str, finish="stop",
          stop_string=None) -> dict:
    t = turn(body)
    plan = parsing.plan(t.chat_request())
    ids = tokenizer.encode(text, add_special_tokens=False)
    completion = Completion()
    completion.add(GenerationDelta(text, len(ids), 9, finish, token_ids=ids,
                                   num_cached_tokens=4, num_cache_write_tokens=3,
                                   stop_string=stop_string))
    return t.full(plan.choice_parser(prompt_ids), completion)


def test_a_whole_answer_with_calls_is_a_message_anthropic_reads(parsing, tokenizer, prompt_ids):
    message = Message.model_validate(whole(parsing, tokenizer, prompt_ids,
                                           {"messages": ASK, "tools": [WEATHER, TIME]},
                                           TWO_CALLS))
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", {"city": "Zürich", "unit": "C"}),
        ("tool_use", "get_time", {"tz": "CET"})]
    # The prompt's 9 tokens: 4 read from the prefix cache, 3 written to it, 2 neither.
    assert message.usage.input_tokens == 2 and message.usage.cache_read_input_tokens == 4
    assert message.usage.cache_creation_input_tokens == 3


@pytest.mark.parametrize("finish, stop_string, reason", [
    ("length", None, "max_tokens"), ("stop", "END", "stop_sequence"), ("stop", None, "end_turn")])
def test_stop_reasons(parsing, tokenizer, prompt_ids, finish, stop_string, reason):
    message = Message.model_validate(whole(parsing, tokenizer, prompt_ids, {"messages": ASK},
                                           "Hello", finish, stop_string))
    assert (message.stop_reason, message.stop_sequence) == (reason, stop_string)


def streamed(t: MessagesTurn, parser, tokenizer, text: str, merge: int) -> list:
    encoder = t.stream_encoder(parser)
    out = encoder.opening()
    deltas = stream_deltas(tokenizer, text, merge)
    for i, (piece, ids) in enumerate(deltas):
        out += encoder.encode(GenerationDelta(piece, len(ids), 9,
                                              "stop" if i == len(deltas) - 1 else None,
                                              token_ids=ids))
    out += encoder.closing()
    events = []
    for chunk in [c for c in out.decode().split("\n\n") if c]:
        kind, data = chunk.split("\n")
        e = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {e.type}"
        events.append(e)
    return events


def reassemble(events) -> list[dict]:
    """The content blocks a client builds from the events."""
    blocks: dict[int, dict] = {}
    for e in events:
        if e.type == "content_block_start":
            blocks[e.index] = {**e.content_block.model_dump(exclude_none=True), "json": ""}
        elif e.type == "content_block_delta":
            d = e.delta
            if d.type == "text_delta":
                blocks[e.index]["text"] += d.text
            elif d.type == "thinking_delta":
                blocks[e.index]["thinking"] += d.thinking
            else:
                blocks[e.index]["json"] += d.partial_json
    return [blocks[i] for i in sorted(blocks)]


@pytest.mark.parametrize("merge", [1, 4, 1000])
def test_streamed_tool_use_is_the_whole_answers_blocks(parsing, tokenizer, prompt_ids, merge):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "stream": True}
    t = turn(body)
    events = streamed(t, parsing.plan(t.chat_request()).choice_parser(prompt_ids), tokenizer,
                      TWO_CALLS, merge)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert events[-2].delta.stop_reason == "tool_use"
    expected = whole(parsing, tokenizer, prompt_ids, body, TWO_CALLS)["content"]
    assert [(b["name"], json.loads(b["json"])) for b in reassemble(events)] == \
        [(b["name"], b["input"]) for b in expected]


def test_streamed_thinking_is_a_thinking_block_before_the_text(thinking_parsing):
    tokenizer = thinking_parsing.tokenizer
    t = turn({"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    events = streamed(t, thinking_parsing.plan(t.chat_request()).choice_parser([1, 2]),
                      tokenizer, THOUGHT, 1)
    blocks = reassemble(events)
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == "The user greets me; greet back."
    assert blocks[1]["text"] == "Hello there!"
