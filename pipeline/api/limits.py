"""Per-request limits from `router.limits`, checked after parsing and before tokenization."""

from __future__ import annotations

from moonserve.pipeline.config import LimitsConfig
from moonserve.pipeline.api.errors import bad_request
from moonserve.pipeline.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


def check_chat_limits(request: ChatCompletionRequest, limits: LimitsConfig) -> None:
    check_message_limits(request.messages, len(request.image_parts()), limits)
    check_choices(request.n, limits)
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    check_max_tokens(request.requested_max_tokens(), param, limits)


def check_message_limits(messages: list[ChatMessage], num_images: int, limits: LimitsConfig) -> None:
    if len(messages) > limits.max_messages:
        raise bad_request(f"messages: {len(messages)} messages exceed the limit of "
                          f"{limits.max_messages} per request", "messages", "too_many_messages")
    for i, message in enumerate(messages):
        if (n := len(message.text())) > limits.max_message_chars:
            raise bad_request(f"messages[{i}].content: {n} characters exceed the limit of "
                              f"{limits.max_message_chars} per message", f"messages[{i}].content",
                              "message_too_long")
    if num_images > limits.max_images:
        raise bad_request(f"messages: {num_images} images exceed the limit of {limits.max_images} "
                          "per request", "messages", "too_many_images")


def check_prompt_chars(prompt: str, limits: LimitsConfig) -> None:
    if len(prompt) > limits.max_message_chars:
        raise bad_request(f"prompt: {len(prompt)} characters exceed the limit of "
                          f"{limits.max_message_chars}", "prompt", "message_too_long")


def check_completion_limits(request: CompletionRequest, limits: LimitsConfig) -> None:
    if isinstance(request.prompt, str):
        check_prompt_chars(request.prompt, limits)
    check_max_tokens(request.max_tokens, "max_tokens", limits)
    check_choices(request.n, limits)


def check_choices(n: int, limits: LimitsConfig) -> None:
    if n > limits.max_choices:
        raise bad_request(f"n: {n} choices exceed this server's limit of {limits.max_choices} per "
                          "request", "n", "too_many_choices")


def check_max_tokens(requested: int | None, param: str, limits: LimitsConfig) -> None:
    if limits.max_tokens and requested and requested > limits.max_tokens:
        raise bad_request(f"{param}: {requested} exceeds this server's limit of {limits.max_tokens}",
                          param, "max_tokens_exceeded")
