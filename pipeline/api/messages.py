"""Anthropic's Messages API on the chat path.

A `POST /v1/messages` request becomes a `ChatCompletionRequest` (`MessagesTurn.chat_request`):
`system`, then each message's blocks as chat messages (`tool_use` blocks as the assistant's tool
calls, `tool_result` blocks as tool messages, `thinking` blocks as its reasoning). It then takes
the chat request's own path in the Router, and the parsed answer comes back as an Anthropic
Message (`MessagesTurn.full`) or as its stream events (`MessagesStream`). Errors are Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`, the message naming the field
(`anthropic_error`).

Example:
    >>> turn = MessagesTurn(body, model="m")
    >>> chat = turn.chat_request()          # a ChatCompletionRequest; 400s name Anthropic's fields
    >>> turn.full(parser, completion)       # the Message of a finished answer
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, ValidationError, model_validator

from moonserve.pipeline.api.errors import (
    APIError,
    bad_request,
    from_validation_error,
    in_fields,
)
from moonserve.pipeline.api.protocol import (
    ChatCompletionRequest,
    ChoiceOutput,
    Completion,
    GenerationDelta,
    RequestModel,
    reject_unsupported,
)
from moonserve.pipeline.api.streaming import typed_event

UNSUPPORTED_FIELDS = ("service_tier", "container", "mcp_servers", "context_management",
                      "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id")
# Anthropic's error type for each status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(exc: APIError) -> dict:
    """An `APIError` in Anthropic's shape; the message names the field, as ours always do."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                           "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


# -- the request ----------------------------------------------------------------------------------

class CacheControl(RequestModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None  # vLLM caches every prefix: accepted, not needed
    citations: None = None


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: StrictStr


class URLSource(RequestModel):
    type: Literal["url"]
    url: StrictStr


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ResultPart] = ""
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(
            p.text for p in self.content if isinstance(p, TextBlock))
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class Tool(RequestModel):
    type: Literal["custom"] | None = None
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise bad_request("tool_choice.name: required with type 'tool', and only there",
                              "tool_choice.name")
        return self


class Thinking(RequestModel):
    """Thinking is on or off: the chat template's switch (a budget is not enforced)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(RequestModel):
    user_id: StrictStr | None = None


class MessagesRequest(RequestModel):
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    # Older API versions' sampling fields (today's SDK sends them through `extra_body`).
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # vLLM caches every prefix: accepted, not needed
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None

    @model_validator(mode="after")
    def _check(self):
        reject_unsupported(self, UNSUPPORTED_FIELDS)
        return self


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)


# -- a turn ---------------------------------------------------------------------------------------

CHAT_PARAMS = [
    (re.compile(r"^max_(completion_)?tokens"), "max_tokens"),
    (re.compile(r"^stop_token_ids|^stop\b"), "stop_sequences"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^reasoning_effort"), "thinking"),
    (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
]
MESSAGE_INDEX = re.compile(r"messages\[(\d+)\](\.content(\[\d+\])?)?")


class MessagesTurn:
    """One `POST /v1/messages` (or its `count_tokens`): `messages` are its chat messages, and
    `origins` name the field each came from (for the 400s)."""

    def __init__(self, body: MessagesRequest, model: str):
        self.body = body
        self.model = model
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.messages, self.origins = chat_messages(body)

    def chat_request(self) -> ChatCompletionRequest:
        b = self.body
        chat: dict[str, Any] = {"model": b.model, "messages": self.messages,
                                "max_tokens": b.max_tokens, "stream": b.stream}
        for name, value in (("temperature", b.temperature), ("top_p", b.top_p),
                            ("top_k", b.top_k), ("stop", b.stop_sequences or None),
                            ("user", b.metadata.user_id if b.metadata else None)):
            if value is not None:
                chat[name] = value
        if b.tools:
            chat["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description else {})}} for t in b.tools]
        if b.tool_choice is not None:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                b.tool_choice.type) or {"type": "function",
                                        "function": {"name": b.tool_choice.name}}
            if b.tool_choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        effort = b.output_config.effort if b.output_config else None
        if b.thinking is not None and b.thinking.type == "disabled":
            chat["reasoning_effort"] = "none"
        elif b.thinking is not None or effort is not None:
            chat["reasoning_effort"] = effort or "high"
        if b.output_config is not None and b.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": b.output_config.format.schema_, "strict": True}}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise self.renamed(from_validation_error(exc)) from None
        except APIError as exc:
            raise self.renamed(exc) from None

    def renamed(self, exc: APIError) -> APIError:
        """A chat validation error with the Messages API's field names (a chat message's
        content index is dropped: tool results leave a user turn's blocks as messages of their
        own)."""
        return in_fields(exc, self.origins, CHAT_PARAMS, MESSAGE_INDEX)

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                completion: Completion) -> dict:
        u = completion.usage
        # Anthropic's three parts add up to the prompt: read from the prefix cache, written to
        # it, and the rest.
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": u.prompt_tokens - u.cached_tokens - u.cache_write_tokens,
                          "cache_read_input_tokens": u.cached_tokens,
                          "cache_creation_input_tokens": u.cache_write_tokens,
                          "output_tokens": u.completion_tokens}}

    def stream_encoder(self, parser) -> MessagesStream:
        return MessagesStream(self, parser)

    def full(self, parser, completion: Completion) -> dict:
        """The Message of a whole answer (`parser`: the chat choice parser of choice 0)."""
        choice = completion.in_order()[0]
        message = parser.finish(choice)
        content = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append({"type": "tool_use", "id": call["id"],
                            "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"] or "{}")})
        called = any(block["type"] == "tool_use" for block in content)
        return self.message(content, *stop(choice, called), completion)


def stop(choice: ChoiceOutput, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a finished choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return "end_turn", None


def chat_messages(body: MessagesRequest) -> tuple[list[dict], list[str]]:
    """The chat messages of a Messages request, and for each the field it came from. A user
    message's `tool_result` blocks become tool messages before what else it carries."""
    messages: list[dict] = []
    origins: list[str] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else \
            "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
        origins.append("system")
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            origins.append(where)
            continue
        blocks = list(enumerate(message.content))
        if message.role == "assistant":
            check_blocks(blocks, where, (TextBlock, ToolUseBlock, ThinkingBlock))
            text = "".join(b.text for _, b in blocks if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for _, b in blocks if isinstance(b, ToolUseBlock)]
            out: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                out["tool_calls"] = calls
            thinking = "".join(b.thinking for _, b in blocks if isinstance(b, ThinkingBlock))
            if thinking:
                out["reasoning_content"] = thinking
            messages.append(out)
            origins.append(where)
            continue
        check_blocks(blocks, where, (TextBlock, ImageBlock, ToolResultBlock))
        for j, block in blocks:
            if isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": block.text()})
                origins.append(f"{where}.content[{j}]")
        parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else
                 {"type": "image_url", "image_url": {"url": b.url()}}
                 for _, b in blocks if isinstance(b, (TextBlock, ImageBlock))]
        if parts:
            messages.append({"role": "user", "content": parts})
            origins.append(where)
    return messages, origins


def check_blocks(blocks: list[tuple[int, Any]], where: str, allowed: tuple[type, ...]) -> None:
    for j, block in blocks:
        if not isinstance(block, allowed):
            param = f"{where}.content[{j}].type"
            raise bad_request(f"{param}: a {block.type} block is not allowed in this role's "
                              "message", param)


# -- streaming ------------------------------------------------------------------------------------

class MessagesStream:
    """Chat deltas of one answer as Anthropic's events: `message_start`, per content block
    `content_block_start`, its deltas and `content_block_stop`, then `message_delta` (stop reason,
    output tokens) and `message_stop`. The interface of
    `moonserve.pipeline.api.streaming.StreamEncoder`."""

    def __init__(self, turn: MessagesTurn, parser):
        self.turn = turn
        self.parser = parser
        self.completion = Completion()
        self.index = -1  # the open content block's index
        self.open: str | None = None  # its type
        self.calls: set[int] = set()  # tool call indexes with a block
        self.called = False

    @property
    def request_id(self) -> str:
        return self.turn.message_id

    def opening(self) -> bytes:
        return b""  # message_start waits for the first delta: it carries the prompt's usage

    def encode(self, delta: GenerationDelta) -> bytes:
        out = b""
        if not self.completion.choices:
            self.completion.add(delta)
            start = self.turn.message([], None, None, self.completion)
            start["usage"]["output_tokens"] = 0
            out += typed_event("message_start", {"message": start})
        else:
            self.completion.add(delta)
        body = self.parser.delta(delta.text, delta.token_ids, delta.finish_reason) or {}
        if body.get("reasoning_content"):
            out += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": body["reasoning_content"]})
        if body.get("content"):
            out += self.block("text", {"type": "text", "text": ""},
                              {"type": "text_delta", "text": body["content"]})
        for call in body.get("tool_calls") or ():
            out += self.call(call)
        return out

    def block(self, kind: str, start: dict, delta: dict) -> bytes:
        out = b""
        if self.open != kind:
            out += self.close()
            self.index += 1
            self.open = kind
            out += typed_event("content_block_start",
                               {"index": self.index, "content_block": start})
        return out + typed_event("content_block_delta",
                                 {"index": self.index, "delta": delta})

    def call(self, call: dict) -> bytes:
        out = b""
        function = call.get("function") or {}
        index = call.get("index", 0)
        if index not in self.calls:
            self.calls.add(index)
            self.called = True
            out += self.close()
            self.index += 1
            self.open = f"tool_use {index}"
            out += typed_event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                "name": function.get("name", ""), "input": {}}})
        if function.get("arguments") and self.open == f"tool_use {index}":
            out += typed_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": function["arguments"]}})
        return out

    def close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return typed_event("content_block_stop", {"index": self.index})

    def error(self, exc: APIError) -> bytes:
        return typed_event("error", {"error": anthropic_error(exc)["error"]})

    def closing(self, with_usage: bool = True) -> bytes:
        if not with_usage or not self.completion.choices:
            return b""  # the error event ended the stream
        choice = self.completion.in_order()[0]
        stop_reason, stop_sequence = stop(choice, self.called)
        u = self.completion.usage
        return self.close() + typed_event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": u.completion_tokens}}) + typed_event("message_stop", {})
