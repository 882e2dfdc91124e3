"""Turning validated requests into prompt token ids, with the context-length checks.

The router tokenizes (not the LM replica) so it knows each request's prompt length before it spends
any engine time: context-length errors are 400s at the edge, and lane admission can use the count.
"""

from __future__ import annotations

from moonserve.pipeline.api.errors import bad_request
from moonserve.pipeline.api.placeholders import expand_placeholders
from jinja2 import TemplateError

from moonserve.pipeline.api.protocol import ChatMessage, CompletionRequest, ModelInfo


class PromptBuilder:
    """Chat template + tokenizer of the served checkpoint.

    Example:
        >>> builder = PromptBuilder.from_pretrained("/path/to/checkpoint")
        >>> ids = builder.chat_prompt_ids(request.messages)        # list[int]
    """

    def __init__(self, tokenizer, chat_template: str | None = None, rendering=None):
        self.tokenizer = tokenizer
        # Replaces the checkpoint's template (language_model.chat.template); None: its own.
        self.chat_template = chat_template
        # How vLLM renders this model's chats (`Rendering`; Kimi K3 has its own).
        self.rendering = rendering or Rendering()

    @classmethod
    def from_pretrained(cls, path: str, trust_remote_code: bool = False,
                        chat_template: str | None = None) -> PromptBuilder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
                   chat_template)

    def token_id(self, token: str) -> int:
        """The id of a single token of the vocabulary (e.g. the image placeholder)."""
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{token!r} is not one token of this tokenizer (it encodes to {ids}); "
                             "set vision.image_placeholder to one of its special tokens")
        return ids[0]

    def chat_prompt_ids(self, messages: list[ChatMessage], image_placeholder: str = "",
                        image_tokens: list[int] | None = None, *, add_generation_prompt: bool = True,
                        template_kwargs: dict | None = None,
                        template_param: str = "messages",
                        image_text: str | None = None) -> list[int]:
        """Prompt ids; with images, each image's placeholder expanded to its token count.
        `image_text` is an image's text in the prompt (default: the placeholder alone); it holds
        the placeholder once. `template_kwargs` are the other variables of the chat template
        (`tools`, a request's `chat_template_kwargs`, ...); a template that fails is a 400 naming
        `template_param`."""
        rendering = self.rendering
        text = image_placeholder if image_text is None else image_text
        conversation = rendering.conversation([m.template_dict(text) for m in messages])
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                tokenize=rendering.eager, chat_template=self.chat_template,
                **rendering.template_kwargs(template_kwargs or {}))
        except TemplateError as exc:
            raise bad_request(f"{template_param}: the chat template cannot render this request: "
                              f"{exc}", template_param) from None
        # The template writes the special tokens as text; don't add another BOS on top.
        ids = rendered if rendering.eager else \
            self.tokenizer.encode(rendered, add_special_tokens=False)
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
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
        check_token_ids(request.prompt, info, "prompt")
        return list(request.prompt)


class Rendering:
    """How a model's chat is rendered: the checkpoint's template to text, then tokenized (vLLM's
    `HfRenderer`). A model vLLM renders its own way overrides these (Kimi K3:
    `moonserve.pipeline.router.chat_parsing.KimiK3Rendering`)."""

    # Tokenize inside apply_chat_template (structural markers as special tokens, user text as
    # ordinary tokens) instead of rendering text and tokenizing it again.
    eager = False

    def conversation(self, messages: list[dict]) -> list[dict]:
        return messages

    def template_kwargs(self, kwargs: dict) -> dict:
        return kwargs


def check_token_ids(ids: list[int], info: ModelInfo, param: str) -> None:
    """A 400 naming `param[i]` for the first id outside the model's vocabulary."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}[{bad}]: token id {ids[bad]} is outside the vocabulary "
                          f"[0, {info.vocab_size})", f"{param}[{bad}]")


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
