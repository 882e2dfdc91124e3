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
    "top_logprobs", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options",
)
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
    logprobs: Any = None
    # vLLM extension, used by benchmarks to produce a fixed number of tokens.
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
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs: not supported by this server", "logprobs", "unsupported_parameter")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


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
    top_logprobs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        reject_unsupported(self, UNSUPPORTED_CHAT_FIELDS)
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


class CompletionRequest(SamplingFields):
    model: StrictStr
    prompt: StrictStr | list[int] = Field(min_length=1)
    echo: StrictBool = False
    suffix: Any = None
    best_of: Any = None
    logit_bias: Any = None

    @model_validator(mode="after")
    def _check_completion(self):
        reject_unsupported(self, UNSUPPORTED_COMPLETION_FIELDS)
        if self.echo:
            raise bad_request("echo: not supported by this server", "echo", "unsupported_parameter")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


@dataclass(frozen=True)
class SamplingSpec:
    """What the LM deployment turns into `vllm.SamplingParams` (no vLLM import on the router)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


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


@dataclass
class GenerationDelta:
    """LanguageModel -> Router: the text and tokens produced since the previous delta.

    When the router reads slower than the engine produces, vLLM merges pending outputs, so one
    delta may carry several tokens; `num_tokens` says how many.
    """

    text: str
    num_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


def sampling_spec(request: SamplingFields, max_tokens: int) -> SamplingSpec:
    """Map OpenAI sampling fields to a `SamplingSpec`, with OpenAI's defaults."""
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=tuple(request.stop_list()),
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        ignore_eos=request.ignore_eos,
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

    def add(self, delta: GenerationDelta) -> None:
        self.text_parts.append(delta.text)
        self.usage.prompt_tokens = delta.num_prompt_tokens
        self.usage.completion_tokens += delta.num_tokens
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)
