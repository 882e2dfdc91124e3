"""OpenAI API request models and the mapping from a request to what the LM deployment needs.

Requests are validated strictly: unknown fields are rejected as OpenAI does ("Unrecognized request
argument supplied"), fields OpenAI has but moonserve does not implement are rejected by name rather
than silently ignored, and ranges follow the OpenAI reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from moonserve.pipeline.api.errors import bad_request

# Fields of the OpenAI API that this server does not implement; a request that sets one gets a 400
# naming it instead of an answer that silently ignores it.
UNSUPPORTED_CHAT_FIELDS = (
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "logit_bias",
    "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
)
# The most alternatives per token `top_logprobs` (chat) and `logprobs` (completions) may ask for:
# OpenAI's limit for chat, and vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20
# apply_chat_template arguments a request's `chat_template_kwargs` may not override.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt",
                            "return_dict", "chat_template")
UNSUPPORTED_COMPLETION_FIELDS = ("logit_bias", "suffix", "best_of")


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(RequestModel):
    type: Literal["text"]
    text: StrictStr


class ImageURL(RequestModel):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None

    def text(self) -> str:
        """The text parts (what the character limits count)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def render(self, image_placeholder: str) -> str:
        """The content as the template sees it: parts in order, one placeholder per image."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text if isinstance(part, TextPart) else image_placeholder
                         for part in self.content)

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, url) of each image part."""
        if isinstance(self.content, str):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content)
                if isinstance(part, ImagePart)]


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


class SamplingFields(RequestModel):
    """Sampling fields shared by chat and text completions (OpenAI ranges)."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM's sampling extensions, with the ranges vLLM's SamplingParams accepts.
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Used by benchmarks to produce a fixed number of tokens.
    ignore_eos: StrictBool = False

    @model_validator(mode="after")
    def _check_common(self):
        if self.n != 1:
            raise bad_request("n: only n=1 is supported; send separate requests", "n", "unsupported_value")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("stop: at most 4 non-empty sequences", "stop")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """Alternatives per generated token to return (0: the sampled token's only); None: none."""
        raise NotImplementedError


def check_template_kwargs(kwargs: dict | None) -> None:
    reserved = sorted(set(kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise bad_request(f"chat_template_kwargs: {reserved[0]!r} is set by the server and cannot "
                          "be overridden", f"chat_template_kwargs.{reserved[0]}")


def reject_unsupported(model: BaseModel, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(model, name) is not None:
            raise bad_request(f"{name}: not supported by this server", name, "unsupported_parameter")


class ChatCompletionRequest(SamplingFields):
    model: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    # vLLM extension: extra arguments of the chat template (e.g. a thinking switch).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        reject_unsupported(self, UNSUPPORTED_CHAT_FIELDS)
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)
        for i, j, _ in self.image_parts():
            if self.messages[i].role != "user":
                raise bad_request(f"messages[{i}].content[{j}]: image parts are only allowed in "
                                  "user messages", f"messages[{i}].content[{j}]")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request(
                "response_format: only {\"type\": \"text\"} is supported", "response_format",
                "unsupported_parameter",
            )
        return self

    def image_parts(self) -> list[tuple[int, int, str]]:
        """(message index, part index, url) of every image part, in prompt order."""
        return [(i, j, url) for i, m in enumerate(self.messages) for j, url in m.image_urls()]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    model: StrictStr
    prompt: StrictStr | list[int] = Field(min_length=1)
    echo: StrictBool = False
    suffix: Any = None
    best_of: Any = None
    logit_bias: Any = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_completion(self):
        reject_unsupported(self, UNSUPPORTED_COMPLETION_FIELDS)
        if self.echo:
            raise bad_request("echo: not supported by this server", "echo", "unsupported_parameter")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(RequestModel):
    """vLLM's `POST /tokenize`: a completion `prompt` or chat `messages` (one of them)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True
    # None: as the matching endpoint does (a BOS for prompts; the template's own for messages).
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt: send exactly one of prompt and messages", "prompt")
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def image_parts(self) -> list[tuple[int, int, str]]:
        return [(i, j, url) for i, m in enumerate(self.messages or ()) for j, url in m.image_urls()]


class DetokenizeRequest(RequestModel):
    """vLLM's `POST /detokenize`."""

    model: StrictStr | None = None
    tokens: list[int]


@dataclass(frozen=True)
class SamplingSpec:
    """What the LM deployment turns into `vllm.SamplingParams` (no vLLM import on the router);
    every field is named as a `SamplingParams` argument."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    # Alternatives per generated token to return with it; None: no logprobs.
    logprobs: int | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """Router -> LanguageModel: one request, already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # vLLM scheduling priority, lower first (from the request's lane).
    priority: int = 0
    # Set for multimodal requests: the token whose runs in `prompt_token_ids` are image positions.
    image_placeholder_id: int | None = None


@dataclass(frozen=True)
class ImageInfo:
    """ImagePreprocessor -> Router -> VisionEncoder: one preprocessed image.

    `pixel_values` is a Ray ObjectRef to a float32 array [num_patches, 3, 14, 14], so the pixels go
    from the preprocessor to the encoder through the object store without passing the router.
    """

    content_hash: str  # SHA-256 of the image bytes (the encoder cache key)
    grid_thw: tuple[int, int, int]  # in patches
    num_image_tokens: int  # after the 2x2 merge
    image_size: tuple[int, int]  # original (width, height)
    pixel_values: Any


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the `top` alternatives (most likely
    first), as (token text, logprob) pairs."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class GenerationDelta:
    """LanguageModel -> Router: the text and tokens produced since the previous delta.

    When the router reads slower than the engine produces, vLLM merges pending outputs, so one
    delta may carry several tokens; `num_tokens` says how many. `logprobs` has one entry per
    token when the request asked for them.
    """

    text: str
    num_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


def sampling_spec(request: SamplingFields, max_tokens: int) -> SamplingSpec:
    """Map OpenAI sampling fields to a `SamplingSpec`, with OpenAI's defaults."""
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens: {request.min_tokens} is over the {max_tokens} tokens this "
                          "request may generate (max_tokens and the context)", "min_tokens")
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=tuple(request.stop_list()),
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        min_tokens=request.min_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=request.num_logprobs(),
    )


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class Completion:
    """A finished generation, accumulated from deltas."""

    text_parts: list[str] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def add(self, delta: GenerationDelta) -> None:
        self.text_parts.append(delta.text)
        self.usage.prompt_tokens = delta.num_prompt_tokens
        self.usage.completion_tokens += delta.num_tokens
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(delta.logprobs)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)
