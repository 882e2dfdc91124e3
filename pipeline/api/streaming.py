"""OpenAI response bodies and SSE framing for chat and text completions."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from moonserve.pipeline.api.protocol import (
    ChoiceOutput,
    Completion,
    GenerationDelta,
    TokenLogprob,
    Usage,
)

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    # msgspec: ~10x faster than json.dumps per chunk (UTF-8 as is, not \u-escaped).
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def typed_event(kind: str, payload: dict) -> bytes:
    """An SSE event as the Responses and Messages APIs frame them: an `event:` line, and the
    same name as the data's `type`."""
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(
        {"type": kind, **payload}) + b"\n\n"


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict | None:
    """OpenAI's chat `logprobs`: one entry per token with its `top_logprobs`."""
    if entries is None:
        return None

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob,
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob] | None, text_offset: int) -> dict | None:
    """OpenAI's legacy completions `logprobs`; `text_offset` is where the first token starts in
    the generated text. Each `top_logprobs` map holds the alternatives and the sampled token."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries],
            "text_offset": offsets}


class PlainChoice:
    """A choice's text as it is: the output parser of a model without tool or reasoning parsers
    (and of text completions). `moonserve.pipeline.router.chat_parsing.ChoiceParser` has the
    same methods, backed by vLLM's parsers."""

    calls_streamed = False
    named_call = False

    def finish(self, choice: ChoiceOutput) -> dict:
        return {"content": choice.text}

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None) -> dict | None:
        return {"content": text} if text else None

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        return 0  # no reasoning parser: no thinking tokens


def finish_reason(choice: ChoiceOutput, message: dict, parser) -> str | None:
    """OpenAI's rule: `tool_calls` when the answer called tools (auto or required), `stop` for a
    named tool."""
    called = bool(message.get("tool_calls")) or parser.calls_streamed
    if called and not parser.named_call and choice.finish_reason == "stop":
        return "tool_calls"
    return choice.finish_reason


@dataclass
class ResponseFormat:
    """What distinguishes `chat.completion` from `text_completion` bodies. `parser(index)` gives
    each chat choice its output parser (one per choice: parsers keep stream state)."""

    request_id: str
    model: str
    chat: bool
    parser: Callable[[int], Any] = lambda index: PlainChoice()
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, index: int, delta: dict, finish: str | None,
              logprobs: dict | None = None) -> dict:
        """A chat chunk with `delta` ({"role"}, {"content"}, {"tool_calls"}, ...) or, for text
        completions, a chunk with `delta["content"]` as its text."""
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": delta.get("content", ""), "logprobs": logprobs,
                  "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def logprobs(self, entries: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        """The choice's `logprobs` in this endpoint's shape; `text_offset`: completions only."""
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, text_offset)

    def usage_chunk(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage.as_dict()}

    def full(self, completion: Completion) -> dict:
        choices = []
        for choice in completion.in_order():
            if self.chat:
                parser = self.parser(choice.index)
                message = {"role": "assistant", "refusal": None, **parser.finish(choice)}
                choices.append({"index": choice.index, "message": message,
                                "logprobs": chat_logprobs(choice.logprobs),
                                "finish_reason": finish_reason(choice, message, parser)})
            else:
                choices.append({"index": choice.index, "text": choice.text,
                                "logprobs": completion_logprobs(choice.logprobs, 0),
                                "finish_reason": choice.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": completion.usage.as_dict()}


class StreamEncoder:
    """Turns `GenerationDelta`s into SSE events, tracking usage for the final chunk."""

    def __init__(self, fmt: ResponseFormat, include_usage: bool, n: int = 1):
        self.fmt = fmt
        self.include_usage = include_usage
        self.n = n
        self.completion = Completion()
        self.parsers: dict[int, Any] = {}
        self.text_offsets: dict[int, int] = {}  # characters streamed per choice (text_offset)

    @property
    def request_id(self) -> str:
        return self.fmt.request_id

    def error(self, exc) -> bytes:
        """An `APIError` past the headers: OpenAI clients read an `error` event in the stream."""
        return sse(exc.body())

    def opening(self) -> bytes:
        """The role chunk of each choice, before the first token (as OpenAI and vLLM do)."""
        if not self.fmt.chat:
            return b""
        return b"".join(sse(self.fmt.chunk(i, {"role": "assistant", "content": ""}, None))
                        for i in range(self.n))

    def encode(self, delta: GenerationDelta) -> bytes:
        choice = self.completion.add(delta)
        offset = self.text_offsets.get(delta.index, 0)
        self.text_offsets[delta.index] = offset + len(delta.text)
        parser = self.parsers.get(delta.index)
        if parser is None:
            parser = self.parsers[delta.index] = self.fmt.parser(delta.index) if self.fmt.chat \
                else PlainChoice()
        body = parser.delta(delta.text, delta.token_ids, delta.finish_reason)
        if body is None and delta.finish_reason is None and not delta.logprobs:
            return b""
        finish = None if delta.finish_reason is None else \
            finish_reason(choice, body or {}, parser)
        return sse(self.fmt.chunk(delta.index, body or {}, finish,
                                  logprobs=self.fmt.logprobs(delta.logprobs, offset)))

    def closing(self, with_usage: bool = True) -> bytes:
        """The usage chunk (when the request asked for it and `with_usage`), then [DONE]."""
        if not (self.include_usage and with_usage):
            return DONE
        return sse(self.fmt.usage_chunk(self.completion.usage)) + DONE
