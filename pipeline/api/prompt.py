"""Turning validated requests into prompt token ids, with the context-length checks.

The router tokenizes (not the LM replica) so it knows each request's prompt length before it spends
any engine time: context-length errors are 400s at the edge, and lane admission can use the count.
"""

from __future__ import annotations

from moonserve.pipeline.api.errors import bad_request
from moonserve.pipeline.api.placeholders import expand_placeholders
from moonserve.pipeline.api.protocol import ChatCompletionRequest, CompletionRequest, ModelInfo


class PromptBuilder:
    """Chat template + tokenizer of the served checkpoint.

    Example:
        >>> builder = PromptBuilder.from_pretrained("/path/to/checkpoint")
        >>> ids = builder.chat_prompt_ids(request)        # list[int]
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str, trust_remote_code: bool = False) -> PromptBuilder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))

    def token_id(self, token: str) -> int:
        """The id of a single token of the vocabulary (e.g. the image placeholder)."""
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{token!r} is not one token of this tokenizer (it encodes to {ids}); "
                             "set vision.image_placeholder to one of its special tokens")
        return ids[0]

    def chat_prompt_ids(self, request: ChatCompletionRequest, image_placeholder: str = "",
                        image_tokens: list[int] | None = None) -> list[int]:
        """Prompt ids; with images, each image's placeholder expanded to its token count."""
        conversation = [{"role": m.role, "content": m.render(image_placeholder)}
                        for m in request.messages]
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        # The template writes the special tokens as text; don't add another BOS on top.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not image_tokens:
            return ids
        try:
            return expand_placeholders(ids, self.token_id(image_placeholder), image_tokens)
        except ValueError:
            raise bad_request(f"messages: the text contains the reserved image token "
                              f"{image_placeholder!r}; remove it", "messages") from None

    def completion_prompt_ids(self, request: CompletionRequest, info: ModelInfo) -> list[int]:
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        bad = next((i for i, t in enumerate(request.prompt) if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"prompt[{bad}]: token id {request.prompt[bad]} is outside the vocabulary "
                f"[0, {info.vocab_size})",
                f"prompt[{bad}]",
            )
        return list(request.prompt)


def resolve_max_tokens(
    num_prompt_tokens: int, requested: int | None, info: ModelInfo, param: str, cap: int | None
) -> int:
    """Check the prompt fits the context and pick `max_tokens`; 400 naming `param` otherwise.

    Unset `max_tokens` means "up to the context limit" (capped by the router's default), as in
    OpenAI's API and vLLM's server.
    """
    room = info.max_model_len - num_prompt_tokens
    if room <= 0:
        raise bad_request(
            f"{param}: the prompt is {num_prompt_tokens} tokens, but this model's maximum context "
            f"length is {info.max_model_len} tokens; shorten the prompt",
            param, "context_length_exceeded",
        )
    if requested is None:
        return min(room, cap) if cap else room
    if requested > room:
        raise bad_request(
            f"max_tokens: this model's maximum context length is {info.max_model_len} tokens; the "
            f"prompt is {num_prompt_tokens} tokens, so at most {room} can be generated, "
            f"not {requested}",
            "max_tokens", "context_length_exceeded",
        )
    return requested
