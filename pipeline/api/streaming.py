"""OpenAI response bodies and SSE framing for chat and text completions."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from moonserve.pipeline.api.protocol import Completion, GenerationDelta, TokenLogprob, Usage

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


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


@dataclass
class ResponseFormat:
    """What distinguishes `chat.completion` from `text_completion` bodies."""

    request_id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def logprobs(self, entries: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        """The choice's `logprobs` in this endpoint's shape; `text_offset`: completions only."""
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, text_offset)

    def usage_chunk(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage.as_dict()}

    def full(self, completion: Completion) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": completion.text, "refusal": None}
            choice = {"index": 0, "message": message,
                      "logprobs": chat_logprobs(completion.logprobs),
                      "finish_reason": completion.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": completion.text,
                      "logprobs": completion_logprobs(completion.logprobs, 0),
                      "finish_reason": completion.finish_reason}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": completion.usage.as_dict()}


class StreamEncoder:
    """Turns `GenerationDelta`s into SSE events, tracking usage for the final chunk."""

    def __init__(self, fmt: ResponseFormat, include_usage: bool):
        self.fmt = fmt
        self.include_usage = include_usage
        self.completion = Completion()
        self.text_offset = 0  # characters streamed so far (completions' text_offset)

    def opening(self) -> bytes:
        """The role chunk, sent before the first token (as OpenAI and vLLM do)."""
        return sse(self.fmt.chunk("", None, first=True)) if self.fmt.chat else b""

    def encode(self, delta: GenerationDelta) -> bytes:
        self.completion.add(delta)
        text_offset, self.text_offset = self.text_offset, self.text_offset + len(delta.text)
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return b""
        return sse(self.fmt.chunk(delta.text, delta.finish_reason,
                                  logprobs=self.fmt.logprobs(delta.logprobs, text_offset)))

    def closing(self) -> bytes:
        usage = sse(self.fmt.usage_chunk(self.completion.usage)) if self.include_usage else b""
        return usage + DONE
