"""The Messages and Responses APIs with SmolLM2's real text, through the `anthropic` and `openai`
clients: a tool use about an image, streamed, validated against its schema and answered with a
`tool_result` (`count_tokens` equal to what the message is charged); a stop sequence named; JSON
formats held; a Responses tool loop continued by `previous_response_id` without resending the
image."""

from __future__ import annotations

import base64
import json

import jsonschema

from tests.conftest import MODEL
from tests.payloads import ANTHROPIC_GREEDY as GREEDY
from tests.payloads import ANTHROPIC_TOOLS, FUNCTIONS, SCHEMAS, data_url, png
from tests.payloads import anthropic_prompt_tokens as prompt_tokens

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


def test_a_tool_loop_continues_by_previous_response_id_without_resending_the_image(client):
    image = data_url(png((64, 48), (200, 30, 30)))
    first = client.responses.create(
        model=MODEL, tools=FUNCTIONS, tool_choice="required", temperature=0,
        max_output_tokens=96, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is the weather in the city in this picture?"},
            {"type": "input_image", "image_url": image}]}])
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=FUNCTIONS, temperature=0,
        max_output_tokens=24, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
               for c in calls])
    assert second.previous_response_id == first.id and second.output_text
    # The second turn's prompt holds the first turn (its image included) without a re-upload.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"] * len(calls)
    first_items = client.responses.input_items.list(first.id)
    assert first_items.data[0].content[1].type == "input_image"


def test_a_json_schema_format_is_held(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Name a city as JSON.", temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
