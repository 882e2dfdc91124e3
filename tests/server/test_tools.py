"""Tool calling, structured outputs and n > 1 in the running app, through the real `openai`
client, on the tiny model: what the grammar holds whatever the model writes (a choice, a JSON
object), errors, and the prompt a tool history renders to (its token count against transformers
rendering the same template). Real calls, validated against their schemas, and the agent SDKs'
loops: tests/smollm2/test_tools.py (a forced call needs a model that ends it: inside a call's
arguments the grammar lets the tiny model write whitespace until max_tokens).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from moonserve.pipeline.models.chat_templates import chat_template_text
from tests.conftest import MODEL
from tests.payloads import ASK, TOOLS


def test_tool_history_is_rendered_by_the_template(client, tokenizer):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, light rain"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              max_tokens=24, temperature=0)
    history = [*ASK, {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
    text = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False,
                                         chat_template=chat_template_text("smollm2_tools"))
    assert "<tool_response>\n18 C, light rain\n</tool_response>" in text
    assert response.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    choice = response.choices[0]
    assert choice.message.content or choice.message.tool_calls


def test_too_few_tokens_for_a_forced_call_is_an_error_that_says_why(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=4, temperature=0)
    assert info.value.body["param"] == "max_tokens" and "tool call" in info.value.body["message"]
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 4, "stream": True}
    events = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).text
    errors = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["param"] == "max_tokens"
    assert events.rstrip().endswith("data: [DONE]")


def test_json_object_and_structured_outputs_extension(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=64, temperature=0)
    content = response.choices[0].message.content
    # The grammar allows only a JSON object (a model alone may answer in prose); a whole answer
    # parses.
    assert content.lstrip().startswith("{"), content
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert response.choices[0].message.content in ("yes", "no")


def test_n_choices_are_indexed_whole_and_streamed(client):
    # top_k 1: every choice is the greedy answer (vLLM takes n > 1 only with temperature > 0).
    greedy = dict(model=MODEL, messages=ASK, temperature=1.0, max_tokens=12,
                  extra_body={"top_k": 1})
    one = client.chat.completions.create(**greedy).choices[0].message.content
    three = client.chat.completions.create(**greedy, n=3)
    assert [(c.index, c.message.content) for c in three.choices] == [(0, one), (1, one), (2, one)]
    assert three.usage.completion_tokens == 3 * len(
        client.chat.completions.create(**greedy, logprobs=True).choices[0].logprobs.content)

    streamed: dict[int, str] = {}
    finished = set()
    usage = None
    for chunk in client.chat.completions.create(**greedy, n=3, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and streamed == {0: one, 1: one, 2: one}
    assert usage.completion_tokens == three.usage.completion_tokens

    sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=3,
                                             seed=7)
    assert len({c.message.content for c in sampled.choices}) > 1, "independent samples"


def test_tokenize_counts_the_tools_a_request_is_charged_for(client, server):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              max_tokens=1)
    counted = httpx.post(f"{server.base_url}/tokenize",
                         json={"model": MODEL, "messages": ASK, "tools": TOOLS}, timeout=30).json()
    without = httpx.post(f"{server.base_url}/tokenize",
                         json={"model": MODEL, "messages": ASK}, timeout=30).json()
    assert counted["count"] == response.usage.prompt_tokens > without["count"]
