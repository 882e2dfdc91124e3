"""Tool calls, reasoning and structured outputs of chat requests, through vLLM's own pieces.

A request is mirrored into vLLM's `ChatCompletionRequest` so that vLLM's parser for the served
model (`ParserManager.get_parser`: the configured tool parser, e.g. `hermes` or `kimi_k3`, and
reasoning parser) can adjust it as vLLM's server does: with tools, the parser replaces the
request's constraint with a structural tag that holds each call to one of the tools and its
arguments to that tool's JSON Schema. moonserve runs it at vLLM's strict level `parameter` by
default, so arguments validate in every `tool_choice` mode, not only for `strict: true` tools.
`response_format` and `structured_outputs` become the same `StructuredOutputsParams`, checked
here with vLLM's own validation so a constraint the backend cannot enforce is a 400 naming the
field, never a silently unconstrained answer.

Outputs go back through the same parser: `ChoiceParser.finish` for a whole answer,
`ChoiceParser.delta` per streamed delta (one parser per choice: they keep stream state).

A plain chat request (no tools, no constraint, no reasoning parser) skips all of this.

Rendering follows vLLM too: a checkpoint vLLM renders with its own renderer (Kimi K3's
`KimiK3Renderer`) gets the same conversation and template arguments here (`KimiK3Rendering`);
every other model its HF chat template (`moonserve.pipeline.api.prompt.Rendering`).

Example:
    >>> parsing = ChatParsing(tokenizer, ChatConfig(tools=ToolsConfig(parser="hermes")))
    >>> plan = parsing.plan(body)              # 400 for a constraint the backend can't enforce
    >>> plan.structured_outputs                 # kwargs of StructuredOutputsParams, or None
    >>> plan.choice_parser(prompt_ids).finish(choice)  # {"content", "tool_calls", ...}
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from moonserve.pipeline.api.errors import APIError, bad_request
from moonserve.pipeline.api.prompt import Rendering
from moonserve.pipeline.api.streaming import PlainChoice
from moonserve.pipeline.api.protocol import ChatCompletionRequest, ChoiceOutput, NamedToolChoice
from moonserve.pipeline.config import STRUCTURED_OUTPUTS, ChatConfig
from moonserve.pipeline.router.json_schemas import enforced_schema

logger = logging.getLogger("moonserve.router")


def client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request (its validation errors are not all ValueErrors)."""
    from vllm.exceptions import VLLMClientError

    return ValueError, VLLMClientError


class ParserTracebacks(logging.Filter):
    """vLLM's tool and reasoning parsers log a traceback (`logger.exception`) for every model
    output they cannot parse, and recover: a call cut short by max_tokens, a malformed call under
    tool_choice auto. Those are outcomes of the model that the API answers as designed (the text
    as content, or `tool_call_incomplete`), so each becomes one debug line (issue 37)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {exc})", None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def quiet_parser_tracebacks(parser_cls) -> None:
    """`ParserTracebacks` on the loggers of the tool and reasoning parsers `parser_cls` composes
    (vLLM names each logger after its module; a subclass's methods log to its bases' too)."""
    for cls in (getattr(parser_cls, "tool_parser_cls", None),
                getattr(parser_cls, "reasoning_parser_cls", None)):
        for module in {base.__module__ for base in cls.__mro__[:-1]} if cls is not None else ():
            parser_logger = logging.getLogger(module)
            if not any(isinstance(f, ParserTracebacks) for f in parser_logger.filters):
                parser_logger.addFilter(ParserTracebacks())


class KimiK3Rendering(Rendering):
    """What vLLM's `KimiK3Renderer` does around the tokenizer's apply_chat_template: tool results
    reordered to their calls (`tool`, `index` added), `enable_thinking` / `reasoning_effort` as
    K3's `thinking` / `thinking_effort`, `tool_choice` only when not `auto`, tokens produced by
    the template itself (its markers are special tokens, the text around them is not)."""

    eager = True

    def conversation(self, messages: list[dict]) -> list[dict]:
        from vllm.renderers.kimi_k3 import _normalize_k3_tool_messages

        return _normalize_k3_tool_messages(messages)

    def template_kwargs(self, kwargs: dict) -> dict:
        from vllm.renderers.kimi_k3 import _apply_k3_thinking_kwargs

        kwargs = dict(kwargs)
        if kwargs.get("tool_choice") == "auto":
            del kwargs["tool_choice"]
        try:
            _apply_k3_thinking_kwargs(kwargs)
        except client_errors() as exc:
            raise bad_request(f"reasoning_effort: {exc}", "reasoning_effort") from None
        return kwargs


# Architectures vLLM renders with its own renderer instead of the HF chat template
# (vllm/config/model.py sets tokenizer_mode from the architecture).
RENDERINGS = {"KimiK3ForConditionalGeneration": KimiK3Rendering}


def rendering_for(model_path: str) -> Rendering:
    """The rendering vLLM uses for the checkpoint at `model_path` (by its architecture)."""
    config = Path(model_path) / "config.json"
    architectures = json.loads(config.read_text()).get("architectures", []) \
        if config.is_file() else []
    return next((RENDERINGS[a]() for a in architectures if a in RENDERINGS), Rendering())


class ChatParsing:
    """One per Router replica: vLLM's parser class for the served model (None without parsers),
    and how its chats are rendered."""

    def __init__(self, tokenizer, config: ChatConfig, rendering: Rendering | None = None):
        from vllm.parser.parser_manager import ParserManager

        from moonserve.pipeline.router.tool_parsers import with_fixed_tool_parser

        self.tokenizer = tokenizer
        self.config = config
        self.rendering = rendering or Rendering()
        self.parser_cls = with_fixed_tool_parser(ParserManager.get_parser(
            tool_parser_name=config.tools.parser, reasoning_parser_name=config.reasoning.parser,
            enable_auto_tools=config.tools.parser is not None,
            tool_strict_level=config.tools.strict_level, tokenizer=tokenizer))
        quiet_parser_tracebacks(self.parser_cls)

    def plan(self, body: ChatCompletionRequest) -> ChatPlan:
        """What this request needs from the engine and from the output parser; 400s first."""
        calls_tools = bool(body.tools) and body.effective_tool_choice() != "none"
        if calls_tools and self.config.tools.parser is None:
            raise bad_request("tools: this model has no tool parser configured "
                              "(language_model.chat.tools.parser)", "tools")
        if not self.needs_vllm(body):  # plain chat: text in, text out, nothing to parse per token
            return ChatPlan(self, body, None, None, body.skip_special_tokens)
        parameters = self.tool_parameters(body) if self.parser_cls is not None and calls_tools \
            else {}
        schema = self.response_schema(body)
        request = self.vllm_request(body, parameters, schema)
        parser = self.new_parser(request, body)
        if parser is not None:
            try:
                request = parser.adjust_request(request)
            except client_errors() as exc:
                raise bad_request(f"tools: {exc}", "tools") from None
        structured = request.extract_structured_outputs()
        if structured is not None and (schema is None or structured.json != schema):
            self.check_structured_outputs(structured, constraint_param(body))
        return ChatPlan(self, body, request, structured_outputs=None if structured is None else
                        {k: v for k, v in vars(structured).items()
                         if not k.startswith("_") and v not in (None, False)},
                        skip_special_tokens=request.skip_special_tokens)

    def needs_vllm(self, body: ChatCompletionRequest) -> bool:
        """Whether the request's output needs vLLM's parsers or its constraint their checks."""
        constrained = body.structured_outputs is not None or (
            body.response_format is not None and body.response_format.type != "text")
        return bool(body.tools) or constrained or self.config.reasoning.parser is not None

    def vllm_request(self, body: ChatCompletionRequest, parameters: dict[int, dict],
                     schema: dict | None):
        """The request as vLLM's protocol model (text only: the parsers never read images), with
        `parameters` (by tool index) and `schema` (the response's) as the JSON Schemas the
        constraint holds them to (`enforced_schema`'s)."""
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as VllmRequest,
        )

        fields = body.model_dump(by_alias=True, exclude_none=True, include={
            "model", "tools", "parallel_tool_calls", "response_format", "structured_outputs",
            "chat_template_kwargs", "reasoning_effort", "skip_special_tokens"})
        for i, parameters_schema in parameters.items():
            fields["tools"][i]["function"]["parameters"] = parameters_schema
        if schema is not None and body.structured_outputs is not None:
            fields["structured_outputs"]["json"] = schema
        elif schema is not None:
            fields["response_format"]["json_schema"]["schema"] = schema
        choice = body.effective_tool_choice()
        messages = [{**m.model_dump(exclude_none=True, include={
            "role", "name", "tool_calls", "tool_call_id", "reasoning_content"}),
            "content": m.render("")} for m in body.messages]
        try:
            return VllmRequest(messages=messages, **fields, tool_choice=choice if isinstance(
                choice, str) else choice.model_dump())
        except client_errors() as exc:
            param = getattr(exc, "parameter", None) or "messages"
            raise bad_request(f"{param}: {exc}", param) from None

    def new_parser(self, request, body: ChatCompletionRequest):
        if self.parser_cls is None:
            return None
        # The kwargs the template got: a reasoning parser reads the thinking switch from them.
        return self.parser_cls(self.tokenizer, request.tools,
                               chat_template_kwargs=self.rendering.template_kwargs(
                                   body.template_kwargs()))

    def tool_parameters(self, body: ChatCompletionRequest) -> dict[int, dict]:
        """Every tool the grammar holds to its schema (at strict level `parameter` every tool the
        call may name, below it the `strict: true` ones), by index: its parameters as xgrammar
        enforces them (`enforced_schema`), or a 400 naming the tool's parameters."""
        choice = body.effective_tool_choice()
        out = {}
        for i, tool in enumerate(body.tools):
            if isinstance(choice, NamedToolChoice) and tool.function.name != choice.function.name:
                continue
            if self.config.tools.strict_level != "parameter" and not tool.function.strict:
                continue
            param = f"tools[{i}].function.parameters"
            out[i] = enforced_schema(tool.function.parameters or {}, param,
                                     self.schema_check(param),
                                     f"the arguments of tool {tool.function.name!r}")
        return out

    def response_schema(self, body: ChatCompletionRequest) -> dict | None:
        """The JSON Schema of `response_format` or `structured_outputs.json` as xgrammar
        enforces it (`enforced_schema`), or a 400 naming the field; None without one."""
        param = constraint_param(body)
        if body.structured_outputs is not None:
            schema = body.structured_outputs.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
                if not isinstance(schema, dict):
                    raise bad_request(f"{param}: a JSON Schema must be an object", param)
        elif body.response_format is not None and body.response_format.type == "json_schema":
            schema = body.response_format.json_schema.schema_
        else:
            return None
        if schema is None:
            return None
        return enforced_schema(schema, param, self.schema_check(param))

    def schema_check(self, param: str):
        """vLLM's own check of a JSON Schema constraint (it compiles it), as `enforced_schema`
        takes it."""
        from vllm.sampling_params import StructuredOutputsParams

        return lambda schema: self.check_structured_outputs(
            StructuredOutputsParams(json=schema), param)

    def check_structured_outputs(self, structured, param: str) -> None:
        """vLLM's own check of a constraint, as the engine runs it (`STRUCTURED_OUTPUTS`:
        xgrammar, which vLLM's check compiles it with)."""
        from vllm.config import StructuredOutputsConfig
        from vllm.sampling_params import SamplingParams

        try:
            # On a copy: the check rewrites some constraints in place (a choice into a grammar).
            params = SamplingParams(structured_outputs=copy.deepcopy(structured))
            # model_config is read only for `is_diffusion`.
            params._validate_structured_outputs(
                SimpleNamespace(is_diffusion=False),
                StructuredOutputsConfig(**STRUCTURED_OUTPUTS), self.tokenizer)
        except client_errors() as exc:
            raise bad_request(f"{param}: {exc}", param) from None


def constraint_param(body: ChatCompletionRequest) -> str:
    """The field a request's constraint came from, as a 400 names it."""
    if body.structured_outputs is not None:
        return "structured_outputs.json" if body.structured_outputs.json_ is not None \
            else "structured_outputs"
    if body.response_format is not None and body.response_format.type == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format" if body.response_format is not None else "tools"


@dataclass
class ChatPlan:
    """One request's constraint for the engine and the parsers of its choices."""

    parsing: ChatParsing
    body: ChatCompletionRequest
    # vLLM's ChatCompletionRequest, adjusted by the parser; None for a plain chat request.
    request: object
    structured_outputs: dict | None
    skip_special_tokens: bool

    def reasoning_ended(self, prompt_ids: list[int]) -> bool | None:
        """vLLM's `reasoning_ended` for the engine: where a constraint starts applying."""
        if self.structured_outputs is None:
            return None
        return self.request.resolve_reasoning_ended(
            self.parsing.new_parser(self.request, self.body), prompt_ids)

    def choice_parser(self, prompt_ids: list[int]) -> ChoiceParser | PlainChoice:
        """A parser for one choice of the request whose prompt is `prompt_ids` (the text as it
        is when the model has no vLLM parser: no tools can be forced then, `plan` refused them)."""
        parser = None if self.request is None else self.parsing.new_parser(self.request, self.body)
        return PlainChoice() if parser is None else ChoiceParser(self, parser, prompt_ids)

    @property
    def forced_call(self) -> bool:
        """`required` or a named tool: every answer must carry a complete call."""
        choice = self.body.effective_tool_choice()
        return bool(self.body.tools) and (choice == "required" or
                                          isinstance(choice, NamedToolChoice))


class ChoiceParser:
    """The output of one choice split into content, reasoning and tool calls (the interface of
    `moonserve.pipeline.api.streaming.PlainChoice`)."""

    def __init__(self, plan: ChatPlan, parser, prompt_ids: list[int]):
        self.plan = plan
        self.parser = parser
        # Where reasoning stands at the first token (a template may open the thinking).
        self.prompt_ids = prompt_ids
        parser.set_prompt_token_ids(prompt_ids)
        self.calls_streamed = False
        # What the stream carried, for the final check of a forced call (None: no check).
        self.streamed = ChoiceOutput(0) if plan.forced_call else None
        self.named_call = isinstance(plan.body.effective_tool_choice(), NamedToolChoice)

    @property
    def uses_tools(self) -> bool:
        return self.parser.tool_parser is not None and bool(self.plan.body.tools) and self.plan.body.effective_tool_choice() != "none"

    def finish(self, choice: ChoiceOutput) -> dict:
        """The message fields of a whole answer."""
        reasoning, content, calls = self.parser.parse(
            choice.text, self.plan.request, enable_auto_tools=self.uses_tools,
            model_output_token_ids=choice.token_ids)
        from vllm.renderers.chat_utils import make_tool_call_id

        tool_calls = [{"id": c.id or make_tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}}
                      for c in calls or ()]
        if self.plan.body.parallel_tool_calls is False:
            tool_calls = tool_calls[:1]
        if self.plan.forced_call and not tool_calls:
            raise forced_call_missing(choice, self.plan.body)
        message = {"content": content or (None if tool_calls else "")}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the answer's tokens are thinking (vLLM's reasoning parser counts)."""
        return self.parser.count_reasoning_tokens(token_ids)

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None) -> dict | None:
        """The chunk's `delta` (without role), or None when there is nothing to send yet."""
        message = self.parser.parse_delta(text, list(token_ids), self.plan.request,
                                          self.prompt_ids, finished=finish_reason is not None)
        out = {}
        if message is not None:
            if message.content:
                out["content"] = message.content
            if message.reasoning:
                out["reasoning_content"] = message.reasoning
            calls = [c.model_dump(exclude_none=True) for c in message.tool_calls or ()]
            if self.plan.body.parallel_tool_calls is False:
                calls = [c for c in calls if c["index"] == 0]
            if calls:
                self.calls_streamed = True
                out["tool_calls"] = calls
        if self.streamed is None:
            return out or None
        self.streamed.text_parts.append(text)
        self.streamed.token_ids.extend(token_ids)
        if finish_reason is not None:
            # A call whose name went out may still be cut short: parse the whole answer again.
            self.streamed.finish_reason = finish_reason
            ChoiceParser(self.plan, self.plan.parsing.new_parser(self.plan.request, self.plan.body),
                         self.prompt_ids).finish(self.streamed)
        return out or None


def forced_call_missing(choice: ChoiceOutput, body: ChatCompletionRequest) -> APIError:
    """A `required` or named tool_choice answer that ended without a complete call."""
    reason = choice.finish_reason
    if reason == "length":
        return bad_request(
            "max_tokens: the answer reached max_tokens before its tool call was complete; raise "
            "max_tokens (tool_choice requires a call)", "max_tokens", "tool_call_incomplete")
    if reason == "stop" and (body.stop or body.stop_token_ids):
        # The grammar holds the call, but vLLM checks stop strings and ids on the output anyway.
        param = "stop" if body.stop else "stop_token_ids"
        return bad_request(
            f"{param}: a stop sequence ended the answer inside the tool call tool_choice "
            "requires; remove it or use tool_choice auto", param, "tool_call_incomplete")
    # The grammar should have made this impossible: the answer goes to the log for a bug report.
    logger.warning("a forced tool call's answer (finish_reason %s) held no call the parser "
                   "found: %r", reason, choice.text[:2000])
    return APIError(500, f"the model ended ({reason}) without the tool call that tool_choice "
                    "requires", type="internal_error", code="tool_call_missing")
