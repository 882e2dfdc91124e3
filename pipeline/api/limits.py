"""Per-request limits from `router.limits`, checked after parsing and before tokenization."""

from __future__ import annotations

from moonserve.pipeline.config import LimitsConfig
from moonserve.pipeline.api.errors import bad_request
from moonserve.pipeline.api.protocol import ChatCompletionRequest, CompletionRequest


def check_chat_limits(request: ChatCompletionRequest, limits: LimitsConfig) -> None:
    if len(request.messages) > limits.max_messages:
        raise bad_request(f"messages: {len(request.messages)} messages exceed the limit of "
                          f"{limits.max_messages} per request", "messages", "too_many_messages")
    for i, message in enumerate(request.messages):
        if (n := len(message.text())) > limits.max_message_chars:
            raise bad_request(f"messages[{i}].content: {n} characters exceed the limit of "
                              f"{limits.max_message_chars} per message", f"messages[{i}].content",
                              "message_too_long")
    if (n := len(request.image_parts())) > limits.max_images:
        raise bad_request(f"messages: {n} images exceed the limit of {limits.max_images} per "
                          "request", "messages", "too_many_images")
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    check_max_tokens(request.requested_max_tokens(), param, limits)


def check_completion_limits(request: CompletionRequest, limits: LimitsConfig) -> None:
    if isinstance(request.prompt, str) and len(request.prompt) > limits.max_message_chars:
        raise bad_request(f"prompt: {len(request.prompt)} characters exceed the limit of "
                          f"{limits.max_message_chars}", "prompt", "message_too_long")
    check_max_tokens(request.max_tokens, "max_tokens", limits)


def check_max_tokens(requested: int | None, param: str, limits: LimitsConfig) -> None:
    if limits.max_tokens and requested and requested > limits.max_tokens:
        raise bad_request(f"{param}: {requested} exceeds this server's limit of {limits.max_tokens}",
                          param, "max_tokens_exceeded")
