"""Real tool calls and structured outputs from SmolLM2 through the running app and real clients:
the `openai` client (forced calls validated against their JSON Schemas, streamed and whole,
`chat.completions.parse`), the Anthropic client (a streamed tool use, a JSON output format), the
Responses API (a tool loop continued by `previous_response_id`, a JSON Schema format), the OpenAI
Agents SDK (an agent's whole tool loop, on Chat Completions and on the Responses API) and
pydantic-ai (a validated object back). Each asks for the few tokens a call takes.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import MODEL
from tests.payloads import ASK, NAMED, SCHEMAS, TOOLS, data_url, png, reassemble


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


def test_a_tool_call_about_an_image(client):
    image = {"type": "image_url", "image_url": {"url": data_url(png((64, 48), (0, 120, 200)))}}
    ask = {"type": "text", "text": "Where was this taken? Get the weather there."}
    messages = [{"role": "user", "content": [image, ask]}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              tool_choice="required", max_tokens=96, temperature=0)
    for call in response.choices[0].message.tool_calls:
        assert_valid_call(call)


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
    with server.drafter("none"):
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
