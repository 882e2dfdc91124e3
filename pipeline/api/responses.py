"""OpenAI's Responses API on the chat path.

A `POST /v1/responses` request becomes a `ChatCompletionRequest` (`ResponsesTurn.chat_request`):
its `instructions`, the stored turns its `previous_response_id` continues, and its `input` items
as chat messages. From there it takes the chat request's own path in the Router (limits, images,
lanes, tools held to their schemas by vLLM's parsers, drafts), and the parsed answer comes back as
a Response: whole (`ResponsesTurn.full`) or as Responses stream events in OpenAI's order
(`ResponsesStream`). Stored turns live in `moonserve.pipeline.api.response_store`.

Example:
    >>> turn = ResponsesTurn(body, history=[], model="m")
    >>> chat = turn.chat_request()          # a ChatCompletionRequest; 400s name `input[...]`
    >>> turn.full(parser, completion)       # the Response object of a finished answer
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    StrictStr,
    Tag,
    ValidationError,
    model_validator,
)

from moonserve.pipeline.api.errors import (
    APIError,
    bad_request,
    from_validation_error,
    in_fields,
)
from moonserve.pipeline.api.protocol import (
    ChatCompletionRequest,
    Completion,
    GenerationDelta,
    RequestModel,
    reject_unsupported,
)
from moonserve.pipeline.api.streaming import typed_event

# Fields of OpenAI's Responses API this server does not implement: a 400 naming each.
UNSUPPORTED_FIELDS = ("background", "conversation", "prompt", "max_tool_calls", "service_tier",
                      "top_logprobs", "safety_identifier", "prompt_cache_retention",
                      "prompt_cache_options", "context_management", "stream_options")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request ----------------------------------------------------------------------------------

class InputText(RequestModel):
    type: Literal["input_text"]
    text: StrictStr


class InputImage(RequestModel):
    type: Literal["input_image"]
    image_url: StrictStr  # an http(s) or data URL; file ids are not supported
    detail: Literal["auto", "low", "high"] = "auto"


class OutputText(RequestModel):
    """An earlier answer's text, as a client sends its previous output back."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


InputPart = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputPart]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Any = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if not isinstance(p, InputImage))


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else \
            "\n".join(p.text for p in self.output)


class SummaryText(RequestModel):
    type: Literal["summary_text"]
    text: StrictStr


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(RequestModel):
    """Earlier thinking: it goes to the next assistant turn's `reasoning_content`."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(p.text for p in parts)


def item_kind(value: Any) -> str:
    """An item without `type` is a message (OpenAI's "easy input message")."""
    kind = value.get("type", "message") if isinstance(value, dict) else \
        getattr(value, "type", "message")
    return kind if kind in ITEM_KINDS else "message"


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_kind)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: StrictStr


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(RequestModel):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob has


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestModel):
    model: StrictStr
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    include: list[StrictStr] | None = None  # nothing extra to include: only [] is accepted
    truncation: Literal["disabled"] | None = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    safety_identifier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    stream_options: Any = None

    @model_validator(mode="after")
    def _check(self):
        reject_unsupported(self, UNSUPPORTED_FIELDS)
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input: must not be empty", "input")
        if self.include:
            raise bad_request(f"include[0]: {self.include[0]!r} is not supported by this server",
                              "include[0]", "unsupported_parameter")
        return self

    def items(self) -> list:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


# -- a turn: the request as a chat request, the answer as a Response -----------------------------

# Chat fields whose names differ in the Responses API, for the 400s of the chat validation.
CHAT_PARAMS = [
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^reasoning_effort"), "reasoning.effort"),
    (re.compile(r"^messages\b"), "input"),
]


class ResponsesTurn:
    """One `POST /v1/responses`: `history` is the chat messages of the stored turns it continues
    (oldest first), `session` the first of those turns' id; `messages` are this turn's, which
    the store keeps with its answer."""

    def __init__(self, body: ResponsesRequest, history: list[dict], model: str,
                 session: str | None = None, response_id: str | None = None):
        self.body = body
        self.history = history
        self.model = model
        self.response_id = response_id or new_id("resp")
        # The session's turns share a routing key (OpenAI's prompt_cache_key): every Router
        # replica sends them to the LanguageModel replica that holds their prefix.
        self.session = session or self.response_id
        self.created_at = int(time.time())
        items = body.items()
        self.items = [with_id(item.model_dump(exclude_none=True, by_alias=True))
                      for item in items]
        self.messages, origins = input_messages(items, known_calls(history))
        system = ["instructions"] if body.instructions else []
        # For each chat message, the Responses field it came from (for the 400s).
        self.origins_of_chat = system + ["previous_response_id"] * len(history) + origins

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this turn runs as; its 400s name the Responses fields."""
        b = self.body
        system = [{"role": "system", "content": b.instructions}] if b.instructions else []
        messages = system + self.history + self.messages
        chat: dict[str, Any] = {"model": b.model, "messages": messages, "stream": b.stream}
        for name, value in (("max_completion_tokens", b.max_output_tokens),
                            ("temperature", b.temperature), ("top_p", b.top_p),
                            ("parallel_tool_calls", b.parallel_tool_calls), ("user", b.user),
                            ("prompt_cache_key", b.prompt_cache_key or self.session)):
            if value is not None:
                chat[name] = value
        if b.tools is not None:
            chat["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"})} for t in b.tools]
        if isinstance(b.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": b.tool_choice.name}}
        elif b.tool_choice is not None:
            chat["tool_choice"] = b.tool_choice
        if b.text is not None and b.text.format is not None:
            chat["response_format"] = response_format(b.text.format)
        if b.reasoning is not None and b.reasoning.effort is not None:
            chat["reasoning_effort"] = b.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise renamed(from_validation_error(exc), self.origins_of_chat) from None
        except APIError as exc:
            raise renamed(exc, self.origins_of_chat) from None

    def response(self, output: list[dict], status: str, usage: dict | None,
                 incomplete: str | None = None) -> dict:
        """The Response object (OpenAI's shape) with `output` items."""
        b = self.body
        tool_choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, FunctionChoice) \
            else (b.tool_choice or "auto")
        text = b.text.model_dump(exclude_none=True, by_alias=True) if b.text else {}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": b.reasoning.summary if b.reasoning else None},
            "store": b.store, "temperature": b.temperature,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": b.top_p, "truncation": "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }

    def full(self, parser, completion: Completion) -> dict:
        """The Response of a whole answer (`parser`: the chat choice parser of choice 0)."""
        choice = completion.in_order()[0]
        message = parser.finish(choice)
        incomplete = "max_output_tokens" if choice.finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        output = output_items(message, status)
        usage = usage_dict(completion, parser.reasoning_tokens(choice.token_ids))
        return self.response(output, status, usage, incomplete)

    def stream_encoder(self, parser) -> ResponsesStream:
        return ResponsesStream(self, parser)

    def turn_messages(self, response: dict) -> list[dict]:
        """This turn's input and answer as chat messages: what a continuing turn's history gets
        from it (the stored record)."""
        return self.messages + output_messages(response["output"])


def renamed(exc: APIError, origins: list[str]) -> APIError:
    """A chat validation error with the Responses field names."""
    return in_fields(exc, origins, CHAT_PARAMS)


def response_format(fmt) -> dict:
    if isinstance(fmt, TextFormatJsonSchema):
        schema = fmt.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.type}


def with_id(item: dict) -> dict:
    """An input item as stored and listed (`input_items`): every item has an id."""
    if "id" not in item:
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}[item.get("type", "message")]
        item = {"id": new_id(prefix), **item}
    item.setdefault("type", "message")
    return item


def known_calls(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(items: list, calls: set[str]) -> tuple[list[dict], list[str]]:
    """Chat messages of input items, and for each the `input[i]` it came from. Function calls
    join the assistant message before them (one assistant turn); a reasoning item goes to the
    next assistant message's `reasoning_content`. `calls`: the call ids of earlier turns, which
    a `function_call_output` may answer besides this input's own calls."""
    calls = set(calls)
    messages: list[dict] = []
    origins: list[str] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
            continue
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(f"{where}.call_id: {item.call_id!r} matches no function_call "
                                  "before it (in input or the previous response)",
                                  f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
            origins.append(where)
            continue
        if isinstance(item, FunctionCallItem):
            check_arguments(item.arguments, f"{where}.arguments")
            calls.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.role == "assistant":
            messages.append({"role": "assistant", "content": item.text()})
        else:
            messages.append({"role": item.role, "content": message_content(item, where)})
        origins.append(where)
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return messages, origins


def check_arguments(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object as a string", param)


def message_content(item: MessageItem, where: str) -> str | list[dict]:
    if isinstance(item.content, str):
        return item.content
    parts = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputImage):
            detail = None if part.detail == "auto" else part.detail
            parts.append({"type": "image_url",
                          "image_url": {"url": part.image_url, **({"detail": detail}
                                                                  if detail else {})}})
        elif isinstance(part, OutputText):
            raise bad_request(f"{where}.content[{j}]: output_text parts belong to assistant "
                              "messages", f"{where}.content[{j}]")
        else:
            parts.append({"type": "text", "text": part.text})
    return parts


def output_items(message: dict, status: str) -> list[dict]:
    """A parsed chat answer (`content`, `reasoning_content`, `tool_calls`) as output items."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or ():
        out.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                             call["function"]["arguments"], "completed"))
    return out


def output_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a continuing turn's history holds (one assistant turn)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "\n".join(c["text"] for c in item.get("content", ()))
        elif item["type"] == "message":
            message["content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    if message["content"] is None and not message.get("tool_calls"):
        message["content"] = ""
    return [message]


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage_dict(completion: Completion, num_reasoning: int) -> dict:
    u = completion.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


# -- streaming ------------------------------------------------------------------------------------

class ResponsesStream:
    """Chat deltas of one answer as Responses events: `response.created`, `.in_progress`, then
    per output item `output_item.added`, its parts and deltas, `.done` events, and last
    `response.completed` (or `.incomplete`) with the whole Response, which `response` keeps
    for the store. The interface of `moonserve.pipeline.api.streaming.StreamEncoder`."""

    def __init__(self, turn: ResponsesTurn, parser):
        self.turn = turn
        self.parser = parser
        self.completion = Completion()
        self.sequence = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.call_items: dict[int, dict] = {}  # tool call index -> its item
        self.response: dict | None = None

    @property
    def request_id(self) -> str:
        return self.turn.response_id

    def emit(self, kind: str, **payload) -> bytes:
        out = typed_event(kind, {**payload, "sequence_number": self.sequence})
        self.sequence += 1
        return out

    def opening(self) -> bytes:
        started = self.turn.response([], "in_progress", None)
        return self.emit("response.created", response=started) + \
            self.emit("response.in_progress", response=started)

    def encode(self, delta: GenerationDelta) -> bytes:
        self.completion.add(delta)
        body = self.parser.delta(delta.text, delta.token_ids, delta.finish_reason) or {}
        out = b""
        if body.get("reasoning_content"):
            out += self.text_delta("reasoning", body["reasoning_content"])
        if body.get("content"):
            out += self.text_delta("message", body["content"])
        for call in body.get("tool_calls") or ():
            out += self.call_delta(call)
        return out

    def text_delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != kind:
            out += self.close_item()
            item = reasoning_item(new_id("rs"), "") if kind == "reasoning" else \
                message_item(new_id("msg"), "", "in_progress")
            out += self.open_item(item)
            part = item["content"][0]
            out += self.emit("response.content_part.added", item_id=item["id"],
                             output_index=len(self.output), content_index=0,
                             part={**part, "text": ""})
        item = self.open
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return out + self.emit("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=len(self.output), content_index=0, delta=text)
        return out + self.emit("response.output_text.delta", item_id=item["id"],
                               output_index=len(self.output), content_index=0, delta=text,
                               logprobs=[])

    def call_delta(self, call: dict) -> bytes:
        out = b""
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.call_items.get(index)
        if item is None:
            out += self.close_item()
            item = call_item(new_id("fc"), call.get("id") or new_id("call"),
                             function.get("name", ""), "", "in_progress")
            self.call_items[index] = item
            out += self.open_item(item)
        if function.get("arguments") and item is self.open:
            item["arguments"] += function["arguments"]
            out += self.emit("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=len(self.output), delta=function["arguments"])
        return out

    def open_item(self, item: dict) -> bytes:
        self.open = item
        added = {**item, "content": []} if "content" in item else item  # parts come after
        return self.emit("response.output_item.added", output_index=len(self.output),
                         item=added)

    def close_item(self, status: str = "completed") -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = len(self.output)
        out = b""
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                out += self.emit("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"],
                                 logprobs=[])
                item["status"] = status
            else:
                out += self.emit("response.reasoning_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"])
            out += self.emit("response.content_part.done", item_id=item["id"],
                             output_index=index, content_index=0, part=part)
        else:
            item["status"] = "completed"
            out += self.emit("response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, name=item["name"],
                             arguments=item["arguments"])
        self.output.append(item)
        return out + self.emit("response.output_item.done", output_index=index, item=item)

    def error(self, exc: APIError) -> bytes:
        return self.emit("error", code=exc.code, message=exc.message, param=exc.param)

    def closing(self, with_usage: bool = True) -> bytes:
        """The last item's `.done` events, then `response.completed` (`.incomplete` when the
        answer hit max_output_tokens); after an error event, `response.failed`."""
        choice = self.completion.in_order()[0] if self.completion.choices else None
        if not with_usage or choice is None:
            failed = self.turn.response(self.output, "failed", None)
            return self.emit("response.failed", response=failed)
        incomplete = "max_output_tokens" if choice.finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        out = self.close_item(status)
        usage = usage_dict(self.completion, self.parser.reasoning_tokens(choice.token_ids))
        self.response = self.turn.response(self.output, status, usage, incomplete)
        return out + self.emit(f"response.{status}", response=self.response)
