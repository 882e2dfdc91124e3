"""Anthropic's Messages API in the running app, through the `anthropic` client: a message equals
the chat answer to the same conversation, and errors in Anthropic's shape naming the field (a
tool loop with an image, `count_tokens`, stop sequences and a JSON format, which need SmolLM2's
text: tests/smollm2/test_apis.py)."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import MODEL
from tests.payloads import ANTHROPIC_GREEDY as GREEDY
from tests.payloads import ANTHROPIC_TOOLS, anthropic_prompt_tokens as prompt_tokens

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
