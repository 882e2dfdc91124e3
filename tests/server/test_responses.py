"""OpenAI's Responses API in the running app, through the `openai` client (the Agents SDK's
Responses model runs its tool loop in tests/server/test_tools.py): whole and streamed answers
equal the chat answer to the same conversation, a tool loop continued
by `previous_response_id` (with an image that is never sent again), stored turns read back,
listed and deleted, visible to their API key alone and kept across a Router replica's
replacement, and 400s in OpenAI's shape naming the Responses field."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import yaml

from moonserve.pipeline.bench.corpus import data_url
from tests.conftest import LOCAL_CONFIG, MODEL
from tests.server.test_multimodal import png
from tests.server.test_tools import SCHEMAS, TOOLS

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]
GREEDY = {"temperature": 0, "max_output_tokens": 24}


def test_a_response_equals_the_chat_answer_to_the_same_conversation(client):
    response = client.responses.create(model=MODEL, instructions="Answer briefly.",
                                       input="Name a planet.", **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "Name a planet."}],
        temperature=0, max_tokens=24)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_a_stream_reassembles_to_the_stored_response(client):
    events = list(client.responses.create(model=MODEL, input="Count to five.", stream=True,
                                          **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # `.incomplete` when the answer reached max_output_tokens, as OpenAI ends such a stream.
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == final.status
    whole = client.responses.create(model=MODEL, input="Count to five.", store=False, **GREEDY)
    assert whole.output_text == final.output_text


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


def test_a_stored_response_is_deleted_and_then_gone(client):
    response = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert client.responses.retrieve(response.id).id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=response.id,
                                **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_json_schema_format_is_held(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Name a city as JSON.", temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": "Hi", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "Hi", "background": True}, "background"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, **body)
    assert caught.value.body["param"] == param


def test_stored_turns_in_redis_are_their_keys_alone_and_outlive_the_router_replica(
        server, client, redis_url):
    """A Router app whose turns live in Redis (as on a cluster, `router.responses.database`)."""
    keys = ["sk-resp-a", "sk-resp-b"]
    router = {"auth": {"enabled": True, "api_keys": keys}, "responses": {"database": redis_url}}
    with server.router_app("keyed", **router) as url:
        owner, other = (openai.OpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0,
                                      timeout=120) for k in keys)
        response = owner.responses.create(model=MODEL, input="Hi", **GREEDY)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=MODEL, input="Hi", previous_response_id=response.id,
                                   **GREEDY)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):  # the session app's own SQLite file
            client.responses.retrieve(response.id)
        # Anthropic clients send the key as `x-api-key`.
        claude = anthropic.Anthropic(base_url=url, api_key=keys[1], max_retries=0)
        ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert claude.messages.create(**ask).content
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0) \
                .messages.create(**ask)
        assert caught.value.body["error"]["type"] == "authentication_error"
        # A new Router replica (the app redeployed with other arguments) reads what the old
        # one stored.
        limits = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]["router"][
            "limits"]
        server.deploy_router("keyed", **router,
                             limits={**limits, "max_messages": limits["max_messages"] - 1})
        assert owner.responses.retrieve(response.id).output_text == response.output_text
        follow = owner.responses.create(model=MODEL, input="Again", **GREEDY,
                                        previous_response_id=response.id)
        assert follow.usage.input_tokens > response.usage.input_tokens
