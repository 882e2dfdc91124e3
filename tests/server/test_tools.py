"""Tool calling, structured outputs and n > 1 in the running app, through real clients: the
`openai` client (tools, streaming reassembled, `chat.completions.parse`), the OpenAI Agents SDK
(an agent's whole tool loop, on Chat Completions and on the Responses API) and pydantic-ai (a
validated object back).

Arguments are checked against each tool's JSON Schema with `jsonschema`; the conversation history
with tool calls is checked by its prompt token count against transformers rendering the same
template.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from moonserve.pipeline.bench.corpus import data_url
from moonserve.pipeline.models.chat_templates import chat_template_text
from tests.conftest import MODEL
from tests.server.test_multimodal import png
from tests.server.test_speculative_server import drafter

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string"}},
               "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "Current time in a timezone",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def assert_valid_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert call.id and call.type == "function"
    return arguments


@pytest.mark.parametrize("tool_choice, finish", [("required", "tool_calls"), (NAMED, "stop")])
def test_forced_tool_calls_validate(client, tool_choice, finish):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice=tool_choice, max_tokens=96, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == finish
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    if tool_choice == NAMED:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]


def reassemble(chunks) -> tuple[dict[int, dict], str | None]:
    """OpenAI's streamed tool calls put together as a client does: per index, id and name once,
    then the arguments in pieces."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None, "the id is sent once"
                call["id"] = piece.id
            if piece.function and piece.function.name:
                assert call["name"] is None, "the name is sent once"
                call["name"] = piece.function.name
            if piece.function and piece.function.arguments:
                call["arguments"] += piece.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish


def test_streamed_tool_call_equals_the_full_answer(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                  temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    calls, finish = reassemble(chunks)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full]
    assert all(c["id"] for c in calls.values())
    assert chunks[-1].usage.completion_tokens > 0


def test_an_argument_that_holds_the_end_tag_is_still_a_call(client):
    """`const` holds the argument to a value with `</tool_call>` in it, so the model must write the
    end tag inside the call's JSON string; vLLM's hermes parser ended the call there and the
    request answered 500 `tool_call_missing` (moonserve.pipeline.router.tool_parsers)."""
    value = 'say "</tool_call>" \\ then stop'
    echo = {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "const": value}},
        "required": ["text"]}}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Echo the text."}],
                  tools=[echo], tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                  temperature=0)
    [call] = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("echo", {"text": value})
    calls, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("echo", {"text": value})]


def test_parallel_tool_calls_false_gives_one_call(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=128,
        temperature=0)
    assert len(response.choices[0].message.tool_calls) == 1


def test_tool_history_is_rendered_by_the_template(client, reference_model):
    _, tokenizer = reference_model
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


def test_a_tool_call_about_an_image(client):
    image = {"type": "image_url", "image_url": {"url": data_url(png((64, 48), (0, 120, 200)))}}
    ask = {"type": "text", "text": "Where was this taken? Get the weather there."}
    messages = [{"role": "user", "content": [image, ask]}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              tool_choice="required", max_tokens=96, temperature=0)
    for call in response.choices[0].message.tool_calls:
        assert_valid_call(call)


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


class City(BaseModel):
    # Bounded, as a schema for a small model should be: unbounded, SmolLM2 can spend max_tokens
    # on the digits of one integer (the grammar allows any length).
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=10**9)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=96, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_and_structured_outputs_extension(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=64, temperature=0)
    content = response.choices[0].message.content
    # The grammar allows only a JSON object (SmolLM2 alone answers in prose); a whole answer parses.
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


def test_greedy_tools_and_json_schema_are_identical_without_speculation(server, client):
    # Prompts that spell out what to write, so the n-gram drafter's copies get accepted.
    copy = [{"role": "user", "content": 'Call get_weather with {"city": "Paris", "unit": '
             '"celsius"} and then say {"city": "Paris", "unit": "celsius"} again.'}]
    city = [{"role": "user", "content": 'Answer with {"name": "Paris", "country": "France", '
             '"population": 2100000}. Again: {"name": "Paris", "country": "France", '
             '"population": 2100000}'}]
    requests = [dict(messages=copy, tools=TOOLS, tool_choice="required"),
                dict(messages=copy, tools=TOOLS, tool_choice=NAMED),
                dict(messages=city, response_format={"type": "json_schema", "json_schema": {
                    "name": "city", "schema": City.model_json_schema()}})]

    def outputs() -> list:
        answers = [client.chat.completions.create(model=MODEL, max_tokens=64, temperature=0,
                                                  **r).choices[0].message for r in requests]
        return [(m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or ()])
                for m in answers]

    before = server.lm_stats()["num_accepted_tokens"]
    speculated = outputs()
    assert server.lm_stats()["num_accepted_tokens"] > before, "drafts must have been accepted"
    with drafter(server, "none"):
        assert outputs() == speculated


# The Agents SDK's two OpenAI models: Chat Completions, and its default, the Responses API.
@pytest.mark.parametrize("api", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_openai_agents_sdk_runs_its_tool_loop(server, api):
    import agents
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"It is 18 C and raining in {city}."

    model = getattr(agents, api)(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{server.base_url}/v1",
                                                      api_key="unused"))
    agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                  tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=64))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                             run_config=RunConfig(tracing_disabled=True))
    assert calls, "the agent called its tool"
    assert isinstance(result.final_output, str) and result.final_output


def test_pydantic_ai_gets_a_validated_object(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.base_url}/v1",
                                                           api_key="unused"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 96})
    result = agent.run_sync("Describe Paris.")
    assert isinstance(result.output, City) and result.output.name


def test_tokenize_counts_the_tools_a_request_is_charged_for(client, server):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              max_tokens=1)
    counted = httpx.post(f"{server.base_url}/tokenize",
                         json={"model": MODEL, "messages": ASK, "tools": TOOLS}, timeout=30).json()
    without = httpx.post(f"{server.base_url}/tokenize",
                         json={"model": MODEL, "messages": ASK}, timeout=30).json()
    assert counted["count"] == response.usage.prompt_tokens > without["count"]
