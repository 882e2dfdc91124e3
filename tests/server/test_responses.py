"""OpenAI's Responses API in the running app, through the `openai` client: whole and streamed
answers equal the chat answer to the same conversation, stored turns read back, listed and
deleted, visible to their API key alone and kept across a Router replica's replacement, and 400s
in OpenAI's shape naming the Responses field. A tool loop continued by `previous_response_id`
and a JSON Schema format need SmolLM2's text: tests/smollm2/test_apis.py (the Agents SDK's
Responses model runs its tool loop in tests/smollm2/test_tools.py)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import MODEL
from tests.payloads import FUNCTIONS

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
        limits = server.args()["router"]["limits"]
        server.deploy_router("keyed", **router,
                             limits={**limits, "max_messages": limits["max_messages"] - 1})
        assert owner.responses.retrieve(response.id).output_text == response.output_text
        follow = owner.responses.create(model=MODEL, input="Again", **GREEDY,
                                        previous_response_id=response.id)
        assert follow.usage.input_tokens > response.usage.input_tokens
