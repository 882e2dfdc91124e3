"""Anthropic's Messages API in the running app, through the `anthropic` client: a message equals
the chat answer to the same conversation, a tool loop with an image streamed and answered with a
`tool_result`, `count_tokens` equal to what the message is charged, stop sequences, and errors in
Anthropic's shape naming the field."""

from __future__ import annotations

import base64
import json

import anthropic
import jsonschema
import pytest

from tests.conftest import MODEL
from tests.server.test_multimodal import png
from tests.server.test_tools import SCHEMAS, TOOLS

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
# Today's Anthropic SDK has no sampling arguments; the API still reads `temperature`.
GREEDY = {"extra_body": {"temperature": 0}}


def prompt_tokens(usage) -> int:
    """Anthropic's three parts of the prompt: the rest, read from the cache, written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def test_a_message_equals_the_chat_answer_to_the_same_conversation(claude, client):
    message = claude.messages.create(model=MODEL, max_tokens=24, system="Answer briefly.",
                                     messages=[{"role": "user", "content": "Name a planet."}],
                                     **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "Name a planet."}],
        temperature=0, max_tokens=24)
    assert message.content[0].text == chat.choices[0].message.content
    usage = message.usage
    assert prompt_tokens(usage) == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason]


def test_a_streamed_tool_use_about_an_image_and_its_result(claude):
    image = base64.b64encode(png((64, 48), (10, 90, 200))).decode()
    ask = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
        {"type": "text", "text": "What is the weather in the city in this picture?"}]}]
    with claude.messages.stream(model=MODEL, max_tokens=96, messages=ask,
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                **GREEDY) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and first.stop_reason == "tool_use"
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])
    counted = claude.messages.count_tokens(model=MODEL, messages=ask, tools=ANTHROPIC_TOOLS,
                                           tool_choice={"type": "any"})
    assert counted.input_tokens == prompt_tokens(first.usage)
    answer = claude.messages.create(
        model=MODEL, max_tokens=24, tools=ANTHROPIC_TOOLS, **GREEDY,
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                "content": "Sunny, 21 C"} for u in uses]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_stop_sequence_is_named(claude):
    message = claude.messages.create(model=MODEL, max_tokens=48, stop_sequences=[" "],
                                     messages=[{"role": "user", "content": "Say hello world."}],
                                     **GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " ")


def test_a_json_output_format_is_held(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    message = claude.messages.create(
        model=MODEL, max_tokens=48, messages=[{"role": "user", "content": "A city as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": ANTHROPIC_TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(claude, body, where):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=8, **body)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(where)


def test_an_unknown_model_is_anthropics_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-x", max_tokens=8,
                               messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
