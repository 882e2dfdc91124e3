"""Tool calling and structured outputs without a server or an engine: the embedded model's
tool-aware template, the constraint `ChatParsing.plan` hands the engine, the 400s a request gets
before any engine time, and the outputs parsed back by vLLM's `hermes` parser (whole and
streamed), all with the embedded checkpoint's real tokenizer."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from moonserve.pipeline.api.errors import APIError, from_validation_error
from moonserve.pipeline.api.prompt import PromptBuilder
from moonserve.pipeline.api.protocol import ChatCompletionRequest, ChoiceOutput, GenerationDelta
from moonserve.pipeline.api.streaming import ResponseFormat, StreamEncoder
from moonserve.pipeline.config import ChatConfig, ToolsConfig
from moonserve.pipeline.models.chat_templates import chat_template_text

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Zürich?"}]


def parse(body: dict) -> ChatCompletionRequest:
    """A request as the router validates it (pydantic errors become 400s naming the field)."""
    try:
        return ChatCompletionRequest.model_validate_json(json.dumps({"model": "m", **body}))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def request(**fields) -> ChatCompletionRequest:
    return parse({"messages": USER, **fields})


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def call_text(name: str, arguments: dict) -> str:
    """One call as the template renders it and the model is asked to write it."""
    call = f'{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}'
    return f"<tool_call>\n{call}\n</tool_call>"


def assistant_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return AutoTokenizer.from_pretrained(str(prepare_language_model(progress=False)))


@pytest.fixture(scope="module")
def parsing(tokenizer):
    from moonserve.pipeline.router.chat_parsing import ChatParsing

    return ChatParsing(tokenizer, ChatConfig(tools=ToolsConfig(parser="hermes")))


@pytest.fixture(scope="module")
def parsing_auto_strict(tokenizer):
    """vLLM's server default: arguments pinned only for `strict: true` tools."""
    from moonserve.pipeline.router.chat_parsing import ChatParsing

    return ChatParsing(tokenizer, ChatConfig(tools=ToolsConfig(parser="hermes",
                                                               strict_level="auto")))


@pytest.fixture(scope="module")
def no_parser(tokenizer):
    from moonserve.pipeline.router.chat_parsing import ChatParsing

    return ChatParsing(tokenizer, ChatConfig())


@pytest.fixture(scope="module")
def tools_prompt(tokenizer):
    return PromptBuilder(tokenizer, chat_template_text("smollm2_tools"))


@pytest.fixture(scope="module")
def prompt_ids(tools_prompt):
    body = request(tools=TOOLS)
    return tools_prompt.chat_prompt_ids(body.messages, template_kwargs=body.template_kwargs())


def render(builder: PromptBuilder, body: ChatCompletionRequest, **kwargs) -> str:
    conversation = [m.template_dict("") for m in body.messages]
    return builder.tokenizer.apply_chat_template(
        conversation, tokenize=False, chat_template=builder.chat_template,
        **{**body.template_kwargs(), **kwargs})


# --- the tool-aware template ------------------------------------------------------------------

CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Two\nlines"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "system", "content": "late system"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_without_tools_matches_the_checkpoint_template(tokenizer, tools_prompt, messages,
                                                                add_generation_prompt):
    body = parse({"messages": messages})
    ours = render(tools_prompt, body, add_generation_prompt=add_generation_prompt)
    theirs = render(PromptBuilder(tokenizer), body, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_template_lists_every_tool_in_the_system_turn(tools_prompt):
    body = parse({"messages": [{"role": "system", "content": "Be terse."}, *USER],
                  "tools": TOOLS})
    text = render(tools_prompt, body, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [t["function"] for t in TOOLS]
    assert text.endswith("<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n")


def test_template_renders_calls_and_results_in_hermes_format(tools_prompt):
    body = parse({"tools": TOOLS, "messages": [
        *USER,
        {"role": "assistant", "content": "",
         "tool_calls": [assistant_call("c1", "get_weather", {"city": "Zürich", "unit": "C"}),
                        assistant_call("c2", "get_time", {"tz": "CET"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C, cloudy"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:02"}]})
    text = render(tools_prompt, body, add_generation_prompt=True)
    calls = (call_text("get_weather", {"city": "Zürich", "unit": "C"}) + "\n"
             + call_text("get_time", {"tz": "CET"}))
    assert f"<|im_start|>assistant\n{calls}<|im_end|>\n" in text
    assert ("<|im_start|>user\n<tool_response>\n12 C, cloudy\n</tool_response><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n14:02\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text


def test_template_call_parses_back_into_the_same_calls(tools_prompt, parsing, prompt_ids):
    arguments = [{"city": "Zürich", "unit": "C"}, {"tz": "CET"}]
    body = parse({"tools": TOOLS, "messages": [
        *USER,
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [assistant_call("c1", "get_weather", arguments[0]),
                        assistant_call("c2", "get_time", arguments[1])]}]})
    text = render(tools_prompt, body, add_generation_prompt=False)
    # What the model would generate after the generation prompt `<|im_start|>assistant\n`.
    answer = text.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    ids = tools_prompt.tokenizer.encode(answer, add_special_tokens=False)
    message = parsing.plan(request(tools=TOOLS)).choice_parser(prompt_ids).finish(
        ChoiceOutput(0, [answer], ids, "stop"))
    assert message["content"].strip() == "Checking both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", arguments[0]),
                                                ("get_time", arguments[1])]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_prompt_builder_passes_tools_to_the_template(tools_prompt):
    body = request(tools=TOOLS)
    ids = tools_prompt.chat_prompt_ids(body.messages, template_kwargs=body.template_kwargs())
    text = tools_prompt.tokenizer.decode(ids)
    assert '"name": "get_time"' in text and "<tools>" in text
    plain = tools_prompt.chat_prompt_ids(body.messages)
    assert "<tools>" not in tools_prompt.tokenizer.decode(plain)


def test_template_kwargs_carry_tools_choice_format_and_thinking():
    body = request(tools=[WEATHER], response_format={"type": "json_object"},
                   reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    kwargs = body.template_kwargs()
    assert kwargs["tools"] == [WEATHER]
    assert kwargs["tool_choice"] == "auto"  # OpenAI's default with tools
    assert kwargs["response_format"] == {"type": "json_object"}
    assert kwargs["reasoning_effort"] == "none"
    assert kwargs["enable_thinking"] is True  # chat_template_kwargs win
    assert request(tools=[WEATHER], tool_choice=named("get_weather")).template_kwargs()[
        "tool_choice"] == named("get_weather")
    assert request().template_kwargs() == {}


# --- the plan: what the engine is asked to enforce -------------------------------------------

def structural_tag(plan) -> dict:
    assert set(plan.structured_outputs) == {"structural_tag"}
    return json.loads(plan.structured_outputs["structural_tag"])


def pinned_schemas(tag: dict) -> dict[str, list]:
    """Tool name -> the argument schemas of its tags (one per whitespace variant)."""
    out: dict[str, list] = {}
    for t in tag["format"]["tags"]:
        name = json.loads(t["begin"].split("<tool_call>")[1].strip() + '""}')["name"]
        out.setdefault(name, []).append(t["content"]["json_schema"])
    return out


@pytest.mark.parametrize("tool_choice", ["auto", "required", None])
def test_tool_calls_are_held_to_each_tools_schema(parsing, tool_choice):
    fields = {} if tool_choice is None else {"tool_choice": tool_choice}
    plan = parsing.plan(request(tools=TOOLS, **fields))
    tag = structural_tag(plan)
    schemas = pinned_schemas(tag)
    assert set(schemas) == {"get_weather", "get_time"}
    for tool in TOOLS:
        assert all(s == tool["function"]["parameters"]
                   for s in schemas[tool["function"]["name"]])
    # auto: text or calls (triggered on `<tool_call>`); required: at least one call.
    assert tag["format"]["type"] == ("tags_with_separator" if tool_choice == "required"
                                     else "triggered_tags")
    assert tag["format"]["at_least_one"] is (tool_choice == "required")
    assert plan.skip_special_tokens is False


def test_named_tool_holds_only_that_tool(parsing):
    tag = structural_tag(parsing.plan(request(tools=TOOLS, tool_choice=named("get_time"))))
    schemas = pinned_schemas(tag)
    assert list(schemas) == ["get_time"]
    assert all(s == TIME["function"]["parameters"] for s in schemas["get_time"])
    assert tag["format"]["at_least_one"] and tag["format"]["stop_after_first"]


def test_single_call_when_parallel_tool_calls_is_false(parsing):
    many = structural_tag(parsing.plan(request(tools=TOOLS, tool_choice="required")))
    one = structural_tag(parsing.plan(request(tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False)))
    assert many["format"]["stop_after_first"] is False
    assert one["format"]["stop_after_first"] is True


def test_strict_level_auto_leaves_non_strict_arguments_free(parsing_auto_strict):
    # vLLM's default: no constraint at all for `auto` with non-strict tools ...
    assert parsing_auto_strict.plan(request(tools=TOOLS)).structured_outputs is None
    # ... and for `required` only the call envelope: the arguments are any JSON (`true`).
    tag = structural_tag(parsing_auto_strict.plan(request(tools=TOOLS, tool_choice="required")))
    assert all(s is True for schemas in pinned_schemas(tag).values() for s in schemas)
    # A `strict: true` tool is pinned even there.
    strict = {"type": "function", "function": {**TIME["function"], "strict": True}}
    tag = structural_tag(parsing_auto_strict.plan(request(tools=[WEATHER, strict])))
    schemas = pinned_schemas(tag)
    assert all(s == TIME["function"]["parameters"] for s in schemas["get_time"])
    assert all(s is True for s in schemas["get_weather"])


def test_tool_choice_none_sends_no_constraint(parsing):
    plan = parsing.plan(request(tools=TOOLS, tool_choice="none"))
    assert plan.structured_outputs is None
    assert plan.skip_special_tokens is True
    plain = parsing.plan(request())
    assert (plain.structured_outputs, plain.skip_special_tokens) == (None, True)


def test_response_format_and_structured_outputs_become_constraints(parsing):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plan = parsing.plan(request(response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}))
    assert plan.structured_outputs == {"json": schema}
    assert parsing.plan(request(response_format={"type": "json_object"})).structured_outputs == \
        {"json_object": True}
    assert parsing.plan(request(response_format={"type": "text"})).structured_outputs is None
    assert parsing.plan(request(structured_outputs={"regex": "[a-z]+"})).structured_outputs == \
        {"regex": "[a-z]+"}
    choice = parsing.plan(request(structured_outputs={"choice": ["yes", "no"]})).structured_outputs
    # vLLM's validation turns a choice into the equivalent grammar; either form is the constraint.
    assert choice in ({"choice": ["yes", "no"]}, {"grammar": 'root ::= "yes" | "no"'})


def test_reasoning_ended_without_a_reasoning_parser(parsing, prompt_ids):
    # vLLM's rule: None lets the engine decide (it has no reasoning parser either, so the
    # constraint applies from the first token); `include_reasoning` is on by default.
    assert parsing.plan(request(tools=TOOLS)).reasoning_ended(prompt_ids) is None
    assert parsing.plan(request()).reasoning_ended(prompt_ids) is None


# --- 400s --------------------------------------------------------------------------------------

def rejected(make) -> APIError:
    with pytest.raises(APIError) as err:
        make()
    assert err.value.status == 400
    return err.value


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_tool_parameters_must_be_a_json_schema():
    err = rejected(lambda: request(tools=[WEATHER, TIME, tool("f", {"type": "objekt"})]))
    assert err.param == "tools[2].function.parameters"
    assert "objekt" in err.message


@pytest.mark.parametrize("parameters,keyword", [
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                              "uniqueItems": True}}}, "uniqueItems"),
])
def test_schema_keywords_the_backend_cannot_enforce_are_named(parsing, parameters, keyword):
    err = rejected(lambda: parsing.plan(request(tools=[WEATHER, tool("pick", parameters)])))
    assert err.param == "tools[1].function.parameters"
    assert keyword in err.message and "'pick'" in err.message
    # Nothing is constrained with tool_choice none, so nothing to refuse.
    assert parsing.plan(request(tools=[tool("pick", parameters)], tool_choice="none")) \
        .structured_outputs is None


def test_unenforced_schemas_are_not_refused_at_strict_level_auto(parsing_auto_strict):
    loose = tool("pick", {"type": "object", "properties": {"n": {"type": "integer",
                                                                 "multipleOf": 3}}})
    assert parsing_auto_strict.plan(request(tools=[loose])).structured_outputs is None


def test_named_choice_ignores_the_schemas_of_other_tools(parsing):
    loose = tool("pick", {"type": "object", "properties": {"n": {"type": "integer",
                                                                 "multipleOf": 3}}})
    plan = parsing.plan(request(tools=[WEATHER, loose], tool_choice=named("get_weather")))
    assert list(pinned_schemas(structural_tag(plan))) == ["get_weather"]


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": named("get_date")}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": named("get_time")}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name"),
    ({"tools": [tool("bad name", {})]}, "tools[0].function.name"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
])
def test_invalid_tool_and_format_fields(fields, param):
    assert rejected(lambda: request(**fields)).param == param


def test_n_up_to_128_is_accepted():
    assert request(n=128).n == 128


@pytest.mark.parametrize("messages,param", [
    ([*USER, {"role": "tool", "tool_call_id": "nope", "content": "r"}],
     "messages[1].tool_call_id"),
    ([*USER, {"role": "tool", "content": "r"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c1"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [assistant_call("c1", "f", {})]}],
     "messages[0].tool_calls"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    # The answer must come after the call.
    ([*USER, {"role": "tool", "tool_call_id": "c1", "content": "r"},
      {"role": "assistant", "content": "", "tool_calls": [assistant_call("c1", "f", {})]}],
     "messages[1].tool_call_id"),
])
def test_invalid_tool_history(messages, param):
    assert rejected(lambda: parse({"messages": messages})).param == param


def test_assistant_tool_call_may_have_null_content():
    body = parse({"messages": [*USER, {"role": "assistant", "content": None,
                                       "tool_calls": [assistant_call("c1", "get_time", {})]},
                               {"role": "tool", "tool_call_id": "c1", "content": "14:02"}]})
    assert body.messages[1].template_dict("")["content"] == ""


def test_user_message_with_null_content_is_a_400():
    assert rejected(lambda: parse({"messages": [{"role": "user", "content": None}]})).param == \
        "messages[0].content"


def test_invalid_regex_is_a_400_by_vllms_validation(parsing):
    err = rejected(lambda: parsing.plan(request(structured_outputs={"regex": "[a-"})))
    assert err.param == "structured_outputs"


def test_tools_without_a_configured_parser(no_parser):
    err = rejected(lambda: no_parser.plan(request(tools=TOOLS)))
    assert err.param == "tools" and "parser" in err.message
    assert no_parser.plan(request(tools=TOOLS, tool_choice="none")).structured_outputs is None


# --- parsing outputs ---------------------------------------------------------------------------

def stream_deltas(tokenizer, text: str, merge: int = 1) -> list[tuple[str, list[int]]]:
    """`text` as the engine streams it: `merge` tokens per delta, text decoded incrementally
    (a token that ends inside a UTF-8 character waits for the next one)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, sent, pending = [], "", []
    for start in range(0, len(ids), merge):
        pending += ids[start:start + merge]
        decoded = tokenizer.decode(ids[:start + merge])
        if decoded.endswith("\ufffd") and start + merge < len(ids):
            continue
        out.append((decoded[len(sent):], pending))
        sent, pending = decoded, []
    assert "".join(t for t, _ in out) == text
    return out


def run_stream(parser, deltas, finish_reason: str = "stop") -> list[dict]:
    bodies = []
    for i, (text, ids) in enumerate(deltas):
        body = parser.delta(text, ids, finish_reason if i == len(deltas) - 1 else None)
        if body is not None:
            bodies.append(body)
    return bodies


def reassemble(bodies: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) from streamed deltas, checking OpenAI's stream shape: one id and one
    name per call index, in the call's first chunk; arguments concatenated."""
    content, calls = "", {}
    for body in bodies:
        content += body.get("content", "")
        for c in body.get("tool_calls", ()):
            if c["index"] not in calls:
                assert c["id"] and c["function"]["name"], c
                calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"],
                                     "arguments": c["function"].get("arguments", "")}
            else:
                assert "id" not in c and "name" not in c["function"], c
                calls[c["index"]]["arguments"] += c["function"].get("arguments", "")
    assert list(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def finished(parser, tokenizer, text: str, finish_reason: str = "stop") -> dict:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return parser.finish(ChoiceOutput(0, [text], ids, finish_reason))


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", ())]


ONE_CALL = call_text("get_weather", {"city": "Zürich", "unit": "C"})
TWO_CALLS = ONE_CALL + "\n" + call_text("get_time", {"tz": "CET"})


@pytest.mark.parametrize("merge", [1, 3, 7, 1000])
@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS])
def test_streamed_calls_equal_the_whole_answer(parsing, tokenizer, prompt_ids, text, merge):
    plan = parsing.plan(request(tools=TOOLS))
    whole = finished(plan.choice_parser(prompt_ids), tokenizer, text)
    streamer = plan.choice_parser(prompt_ids)
    content, calls = reassemble(run_stream(streamer, stream_deltas(tokenizer, text, merge)))
    assert content == ""
    assert whole["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == calls_of(whole)
    assert len(calls) == text.count("<tool_call>")
    assert streamer.calls_streamed


@pytest.mark.parametrize("merge", [1, 4])
def test_content_before_a_call_streams_as_content(parsing, tokenizer, prompt_ids, merge):
    text = "Let me look that up. " + ONE_CALL
    plan = parsing.plan(request(tools=TOOLS))
    content, calls = reassemble(run_stream(plan.choice_parser(prompt_ids),
                                           stream_deltas(tokenizer, text, merge)))
    assert content == "Let me look that up. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Zürich", "unit": "C"})]
    whole = finished(plan.choice_parser(prompt_ids), tokenizer, text)
    assert whole["content"] == "Let me look that up. "


def test_plain_answer_in_auto_mode_is_content(parsing, tokenizer, prompt_ids):
    text = "It is 12 degrees in Zürich."
    plan = parsing.plan(request(tools=TOOLS))
    assert finished(plan.choice_parser(prompt_ids), tokenizer, text) == {"content": text}
    parser = plan.choice_parser(prompt_ids)
    assert reassemble(run_stream(parser, stream_deltas(tokenizer, text))) == (text, [])
    assert not parser.calls_streamed


def test_tool_choice_none_leaves_call_text_as_content(parsing, tokenizer, prompt_ids):
    plan = parsing.plan(request(tools=TOOLS, tool_choice="none"))
    assert finished(plan.choice_parser(prompt_ids), tokenizer, ONE_CALL) == {"content": ONE_CALL}


@pytest.mark.parametrize("merge", [1, 5])
def test_parallel_tool_calls_false_keeps_the_first_call(parsing, tokenizer, prompt_ids, merge):
    plan = parsing.plan(request(tools=TOOLS, parallel_tool_calls=False))
    assert calls_of(finished(plan.choice_parser(prompt_ids), tokenizer, TWO_CALLS)) == \
        [("get_weather", {"city": "Zürich", "unit": "C"})]
    _, calls = reassemble(run_stream(plan.choice_parser(prompt_ids),
                                     stream_deltas(tokenizer, TWO_CALLS, merge)))
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", named("get_weather")])
def test_forced_call_cut_by_length_is_a_400_naming_max_tokens(parsing, tokenizer, prompt_ids,
                                                              tool_choice):
    plan = parsing.plan(request(tools=TOOLS, tool_choice=tool_choice))
    cut = '<tool_call>\n{"na'
    err = rejected(lambda: finished(plan.choice_parser(prompt_ids), tokenizer, cut, "length"))
    assert err.param == "max_tokens" and err.code == "tool_call_incomplete"
    err = rejected(lambda: run_stream(plan.choice_parser(prompt_ids),
                                      stream_deltas(tokenizer, cut), "length"))
    assert err.param == "max_tokens"
    # A complete call within the limit is no error, whatever the finish reason.
    assert calls_of(finished(plan.choice_parser(prompt_ids), tokenizer, ONE_CALL, "length"))


def test_forced_call_cut_inside_its_arguments_streams_the_400(parsing, tokenizer, prompt_ids):
    plan = parsing.plan(request(tools=TOOLS, tool_choice="required"))
    cut = ONE_CALL[:ONE_CALL.index("Zürich")]
    rejected(lambda: finished(plan.choice_parser(prompt_ids), tokenizer, cut, "length"))
    rejected(lambda: run_stream(plan.choice_parser(prompt_ids), stream_deltas(tokenizer, cut),
                                "length"))


# What `moonserve bench soak` found (1 in about 1,300 forced calls, answered 500): a sampled call
# under the forced-call grammar, which lets a string hold any text, with the end tag in its
# argument. vLLM's hermes parser cut the call there (vLLM issue 45167).
TAG_IN_STRING = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "La Coruña,Espaial'
                 '</tool_call-name></tool_call>,"}}\n</tool_call>')
TAG_IN_STRING_CALLS = [("get_weather", {"city": "La Coruña,Espaial</tool_call-name></tool_call>,"})]
# Escaped quotes and backslashes around the tag, then a second call.
ESCAPES = call_text("get_weather", {"city": 'a "</tool_call>" b \\', "unit": "C"}) + "\n" + \
    call_text("get_time", {"tz": '\\"</tool_call>'})
ESCAPES_CALLS = [("get_weather", {"city": 'a "</tool_call>" b \\', "unit": "C"}),
                 ("get_time", {"tz": '\\"</tool_call>'})]


@pytest.mark.parametrize("merge", [1, 3, 1000])
@pytest.mark.parametrize("text, expected", [(TAG_IN_STRING, TAG_IN_STRING_CALLS),
                                            (ESCAPES, ESCAPES_CALLS)])
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_an_end_tag_inside_an_argument_string_does_not_end_the_call(
        parsing, tokenizer, prompt_ids, text, expected, merge, tool_choice):
    plan = parsing.plan(request(tools=TOOLS, tool_choice=tool_choice))
    assert calls_of(finished(plan.choice_parser(prompt_ids), tokenizer, text)) == expected
    content, calls = reassemble(run_stream(plan.choice_parser(prompt_ids),
                                           stream_deltas(tokenizer, text, merge)))
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected


def test_a_call_nested_past_jsons_limit_is_content_under_auto(parsing, tokenizer, prompt_ids):
    text = "<tool_call>" + "[" * 5000 + "</tool_call>"  # json.loads: RecursionError
    plan = parsing.plan(request(tools=TOOLS))
    assert finished(plan.choice_parser(prompt_ids), tokenizer, text) == {"content": text}


def test_vllms_own_hermes_parser_still_cuts_such_a_call(tokenizer):
    """moonserve.pipeline.router.tool_parsers exists for this: when vLLM's parser reads the call
    (its fix merged), this fails, and that module can go."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    for text in (TAG_IN_STRING, ESCAPES):
        assert not Hermes2ProToolParser(tokenizer).extract_tool_calls(text, None).tools_called


def test_calls_cut_short_log_no_traceback(parsing, tokenizer, prompt_ids, caplog):
    """vLLM's hermes parser logs `logger.exception` for a call it cannot parse; a call cut by
    max_tokens is an expected outcome (answered as `tool_call_incomplete`, or as content under
    auto): no traceback, at most one debug line per parse."""
    cut = ONE_CALL[:ONE_CALL.index("Zürich")]
    auto = parsing.plan(request(tools=TOOLS))
    forced = parsing.plan(request(tools=TOOLS, tool_choice="required"))
    with caplog.at_level("DEBUG"):
        assert finished(auto.choice_parser(prompt_ids), tokenizer, cut, "length") == \
            {"content": cut}
        rejected(lambda: run_stream(forced.choice_parser(prompt_ids),
                                    stream_deltas(tokenizer, cut), "length"))
    parser_records = [r for r in caplog.records if r.name.startswith(
        ("vllm.tool_parsers", "moonserve.pipeline.router.tool_parsers"))]
    assert parser_records, "the parser logged nothing: this test no longer reaches its failure"
    assert all(r.exc_info is None and r.levelno == logging.DEBUG for r in parser_records)
    assert all("\n" not in r.getMessage() for r in parser_records)


# --- response bodies ----------------------------------------------------------------------------

def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n\n")
            if line.startswith("data: {")]


def response_format(plan, prompt_ids) -> ResponseFormat:
    return ResponseFormat("chatcmpl-1", "m", chat=True,
                          parser=lambda index: plan.choice_parser(prompt_ids))


def test_stream_encoder_keeps_choices_apart(parsing, tokenizer, prompt_ids):
    plan = parsing.plan(request(tools=TOOLS, n=2))
    encoder = StreamEncoder(response_format(plan, prompt_ids), include_usage=True, n=2)
    out = encoder.opening()
    call = stream_deltas(tokenizer, ONE_CALL, 4)
    text = stream_deltas(tokenizer, "Sunny.", 1)
    for i in range(max(len(call), len(text))):  # interleaved, as the engine sends them
        for index, deltas in enumerate((call, text)):
            if i < len(deltas):
                finish = "stop" if i == len(deltas) - 1 else None
                out += encoder.encode(GenerationDelta(deltas[i][0], len(deltas[i][1]), 9, finish,
                                                      index=index, token_ids=deltas[i][1]))
    out += encoder.closing()
    chunks = events(out)
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == \
        [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    by_index = {0: [], 1: []}
    for c in chunks[2:-1]:
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    _, calls = reassemble([c["delta"] for c in by_index[0]])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Zürich", "unit": "C"})]
    assert reassemble([c["delta"] for c in by_index[1]]) == ("Sunny.", [])
    finishes = {i: [c["finish_reason"] for c in cs if c["finish_reason"]]
                for i, cs in by_index.items()}
    assert finishes == {0: ["tool_calls"], 1: ["stop"]}
    assert chunks[-1]["usage"]["completion_tokens"] == \
        sum(len(ids) for _, ids in call) + sum(len(ids) for _, ids in text)


def full_response(plan, prompt_ids, tokenizer, texts: list[str], finish: str = "stop") -> dict:
    encoder = StreamEncoder(response_format(plan, prompt_ids), include_usage=False,
                            n=len(texts))
    for index, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        encoder.completion.add(GenerationDelta(text, len(ids), 9, finish, index=index,
                                               token_ids=ids))
    return encoder.fmt.full(encoder.completion)


def test_full_response_finish_reasons(parsing, tokenizer, prompt_ids):
    auto = full_response(parsing.plan(request(tools=TOOLS, n=2)), prompt_ids, tokenizer,
                         [ONE_CALL, "Sunny."])
    first, second = auto["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["content"] is None and first["message"]["role"] == "assistant"
    assert calls_of(first["message"]) == [("get_weather", {"city": "Zürich", "unit": "C"})]
    assert first["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert (second["finish_reason"], second["message"]["content"]) == ("stop", "Sunny.")
    assert "tool_calls" not in second["message"]

    required = full_response(parsing.plan(request(tools=TOOLS, tool_choice="required")),
                             prompt_ids, tokenizer, [ONE_CALL])
    assert required["choices"][0]["finish_reason"] == "tool_calls"
    forced = full_response(parsing.plan(request(tools=TOOLS, tool_choice=named("get_weather"))),
                           prompt_ids, tokenizer, [ONE_CALL])
    assert forced["choices"][0]["finish_reason"] == "stop"
    assert calls_of(forced["choices"][0]["message"]) == \
        [("get_weather", {"city": "Zürich", "unit": "C"})]
    # A call cut by max_tokens in auto mode keeps `length`.
    cut = full_response(parsing.plan(request(tools=TOOLS)), prompt_ids, tokenizer, [ONE_CALL],
                        "length")
    assert cut["choices"][0]["finish_reason"] == "length"


# ---- Reasoning: vLLM's reasoning parser splits the thinking off (deepseek_r1's <think> format on
# the embedded tokenizer with its two tags added; production runs kimi_k3 the same way).

@pytest.fixture(scope="module")
def thinking_parsing():
    from transformers import AutoTokenizer

    from moonserve.pipeline.config import ReasoningConfig
    from moonserve.pipeline.prepare.language_model import prepare_language_model
    from moonserve.pipeline.router.chat_parsing import ChatParsing

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_language_model(progress=False)))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return ChatParsing(tokenizer, ChatConfig(reasoning=ReasoningConfig(parser="deepseek_r1")))


THOUGHT = "<think>The user greets me; greet back.</think>Hello there!"


def test_reasoning_goes_to_reasoning_content(thinking_parsing):
    plan = thinking_parsing.plan(request())
    choice = ChoiceOutput(0, [THOUGHT], thinking_parsing.tokenizer.encode(
        THOUGHT, add_special_tokens=False), "stop")
    message = plan.choice_parser([1, 2]).finish(choice)
    assert message == {"content": "Hello there!",
                       "reasoning_content": "The user greets me; greet back."}


def test_streamed_reasoning_and_content_reassemble(thinking_parsing):
    tokenizer = thinking_parsing.tokenizer
    ids = tokenizer.encode(THOUGHT, add_special_tokens=False)
    parser = thinking_parsing.plan(request()).choice_parser([1, 2])
    reasoning = content = ""
    for k, token in enumerate(ids):
        delta = parser.delta(tokenizer.decode([token]), [token],
                             "stop" if k == len(ids) - 1 else None) or {}
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    assert (reasoning, content) == ("The user greets me; greet back.", "Hello there!")


@pytest.mark.parametrize("effort, thinking", [("none", False), ("low", True), ("high", True)])
def test_reasoning_effort_sets_the_templates_thinking_switch(effort, thinking):
    kwargs = request(reasoning_effort=effort).template_kwargs()
    assert kwargs["enable_thinking"] is thinking and kwargs["reasoning_effort"] == effort
    # The request's own chat_template_kwargs win, as in vLLM's server.
    assert request(reasoning_effort=effort, chat_template_kwargs={"enable_thinking": True}) \
        .template_kwargs()["enable_thinking"] is True


def test_forced_call_cut_by_a_stop_sequence_is_a_400_naming_stop(parsing, tokenizer, prompt_ids,
                                                                 caplog):
    cut = "<tool_call>"
    plan = parsing.plan(request(tools=TOOLS, tool_choice="required", stop=["\n"]))
    err = rejected(lambda: finished(plan.choice_parser(prompt_ids), tokenizer, cut, "stop"))
    assert err.param == "stop" and err.code == "tool_call_incomplete"
    plan = parsing.plan(request(tools=TOOLS, tool_choice="required", stop_token_ids=[198]))
    assert rejected(lambda: finished(plan.choice_parser(prompt_ids), tokenizer, cut,
                                     "stop")).param == "stop_token_ids"
    # Without a stop sequence of the request's, a missing call is the server's failure, and its
    # answer goes to the log (the 400s above are the client's and log nothing).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    plan = parsing.plan(request(tools=TOOLS, tool_choice="required"))
    with pytest.raises(APIError) as err:
        finished(plan.choice_parser(prompt_ids), tokenizer, cut, "stop")
    assert err.value.status == 500
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert repr(cut) in record.getMessage()


# ---- Kimi K3: rendered as vLLM's KimiK3Renderer renders it (no K3 tokenizer here: a recording
# tokenizer stands in, the mapping is vLLM's own).

def test_k3_checkpoints_get_vllms_k3_rendering(tmp_path, tokenizer):
    from moonserve.pipeline.api.prompt import Rendering
    from moonserve.pipeline.prepare.language_model import prepare_language_model
    from moonserve.pipeline.router.chat_parsing import KimiK3Rendering, rendering_for
    from moonserve.pipeline.synthetic_checkpoints.k3 import write_k3_config

    assert isinstance(rendering_for(str(write_k3_config(tmp_path / "k3"))), KimiK3Rendering)
    embedded = rendering_for(str(prepare_language_model(progress=False)))
    assert type(embedded) is Rendering and not embedded.eager


@pytest.mark.parametrize("effort, expected", [
    ("none", {"thinking": False}), ("high", {"thinking": True, "thinking_effort": "high"}),
    ("max", {"thinking": True, "thinking_effort": "max"})])
def test_k3_thinking_switches_are_k3s(effort, expected):
    from moonserve.pipeline.router.chat_parsing import KimiK3Rendering

    kwargs = KimiK3Rendering().template_kwargs(request(reasoning_effort=effort).template_kwargs())
    assert kwargs == expected


def test_k3_refuses_an_effort_it_has_not(tmp_path):
    from moonserve.pipeline.router.chat_parsing import KimiK3Rendering

    err = rejected(lambda: KimiK3Rendering().template_kwargs(
        request(reasoning_effort="minimal").template_kwargs()))
    assert err.param == "reasoning_effort"


def test_k3_gets_tool_choice_only_when_not_auto_and_tool_results_in_call_order():
    from moonserve.pipeline.router.chat_parsing import KimiK3Rendering

    k3 = KimiK3Rendering()
    assert "tool_choice" not in k3.template_kwargs(request(tools=TOOLS).template_kwargs())
    assert k3.template_kwargs(request(tools=TOOLS, tool_choice="required").template_kwargs())[
        "tool_choice"] == "required"
    body = request(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [
        assistant_call("c1", "get_weather", {"city": "Bern"}),
        assistant_call("c2", "get_time", {"tz": "CET"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}], tools=TOOLS)
    conversation = k3.conversation([m.template_dict("") for m in body.messages])
    assert [(m["tool_call_id"], m["tool"], m["index"]) for m in conversation[2:]] == \
        [("c1", "get_weather", 1), ("c2", "get_time", 2)]


def test_k3_prompts_are_tokenized_by_the_template_itself():
    from moonserve.pipeline.router.chat_parsing import KimiK3Rendering

    class RecordingTokenizer:
        def apply_chat_template(self, conversation, **kwargs):
            self.kwargs = kwargs
            return [7, 8, 9]

    recorder = RecordingTokenizer()
    builder = PromptBuilder(recorder, rendering=KimiK3Rendering())
    body = request(reasoning_effort="none", tools=TOOLS)
    assert builder.chat_prompt_ids(body.messages, template_kwargs=body.template_kwargs()) == \
        [7, 8, 9]
    assert recorder.kwargs["tokenize"] is True and recorder.kwargs["thinking"] is False
    assert "enable_thinking" not in recorder.kwargs and "tool_choice" not in recorder.kwargs


def test_the_reasoning_parser_reads_the_switch_the_template_got(tokenizer):
    from moonserve.pipeline.router.chat_parsing import ChatParsing, KimiK3Rendering

    parsing = ChatParsing(tokenizer, ChatConfig(tools=ToolsConfig(parser="hermes")),
                          KimiK3Rendering())
    seen = {}

    class RecordingParser:
        def __init__(self, tokenizer, tools, chat_template_kwargs):
            seen.update(chat_template_kwargs)

    parsing.parser_cls = RecordingParser
    parsing.new_parser(SimpleNamespace(tools=None), request(reasoning_effort="none"))
    assert seen == {"thinking": False}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_finish_in_an_empty_delta_leaves_the_call_whole(parsing, tokenizer, prompt_ids,
                                                          tool_choice):
    """The engine's last delta may carry no text (end-of-sequence): the call streamed before it
    must still come out whole."""
    plan = parsing.plan(request(tools=TOOLS, tool_choice=tool_choice))
    deltas = stream_deltas(tokenizer, ONE_CALL, 2) + [("", [])]
    _, calls = reassemble(run_stream(plan.choice_parser(prompt_ids), deltas, "stop"))
    whole = finished(plan.choice_parser(prompt_ids), tokenizer, ONE_CALL)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == calls_of(whole)
