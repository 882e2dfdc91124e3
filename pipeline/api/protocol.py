"""OpenAI API request models and the mapping from a request to what the LM deployment needs.

Requests are validated strictly: unknown fields are rejected as OpenAI does ("Unrecognized request
argument supplied"), fields OpenAI has but moonserve does not implement are rejected by name rather
than silently ignored, and ranges follow the OpenAI reference.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jsonschema
import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from moonserve.pipeline.api.errors import bad_request

# Fields of the OpenAI API that this server does not implement; a request that sets one gets a 400
# naming it instead of an answer that silently ignores it.
UNSUPPORTED_CHAT_FIELDS = (
    "functions", "function_call", "logit_bias", "audio", "modalities", "prediction",
    "web_search_options",
)
# OpenAI's limit on choices per request.
MAX_CHOICES = 128
# The most alternatives per token `top_logprobs` (chat) and `logprobs` (completions) may ask for:
# OpenAI's limit for chat, and vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20
# apply_chat_template arguments a request's `chat_template_kwargs` may not override.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt",
                            "return_dict", "chat_template", "tools")
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


class FunctionCallParam(RequestModel):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as a string (OpenAI's shape)


class ToolCallParam(RequestModel):
    """An earlier call of the assistant, in the conversation history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that carries tool_calls.
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant only
    tool_call_id: StrictStr | None = None  # tool only: the call this message answers
    reasoning_content: StrictStr | None = None  # assistant only: earlier thinking, for templates

    def text(self) -> str:
        """The text parts (what the character limits count)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def render(self, image_placeholder: str) -> str:
        """The content as the template sees it: parts in order, one placeholder per image."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text if isinstance(part, TextPart) else image_placeholder
                         for part in self.content)

    def template_dict(self, image_placeholder: str) -> dict:
        """The message as chat templates read it (tool-call arguments as objects, as vLLM and
        transformers pass them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.render(image_placeholder)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    def check(self, i: int) -> None:
        """Role-specific fields; 400 naming `messages[i].<field>`."""
        where = f"messages[{i}]"
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request(f"{where}.tool_calls: only assistant messages carry tool_calls",
                              f"{where}.tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise bad_request(f"{where}.reasoning_content: only assistant messages carry it",
                              f"{where}.reasoning_content")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise bad_request(f"{where}.tool_call_id: required in tool messages and only there",
                              f"{where}.tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"{where}.content: required (only an assistant message with "
                              "tool_calls may leave it null)", f"{where}.content")
        for j, call in enumerate(self.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                param = f"{where}.tool_calls[{j}].function.arguments"
                raise bad_request(f"{param}: must be a JSON object as a string", param)

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, url) of each image part."""
        if self.content is None or isinstance(self.content, str):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content)
                if isinstance(part, ImagePart)]


class FunctionDefinition(RequestModel):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: StrictBool | None = None


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: StrictStr


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    # `schema` shadows a BaseModel attribute; the alias keeps OpenAI's field name.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextResponseFormat(RequestModel):
    type: Literal["text"]


class JsonObjectResponseFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormatParam = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type")]


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` request extension (one constraint per request)."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: StrictStr | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        kinds = [k for k in ("json_", "regex", "choice", "grammar", "json_object",
                             "structural_tag") if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise bad_request("structured_outputs: set exactly one of json, regex, choice, "
                              "grammar, json_object, structural_tag", "structured_outputs")
        return self


def check_json_schema(schema: dict, param: str) -> None:
    """A 400 naming `param` when `schema` is not a valid JSON Schema (by its own metaschema)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in exc.path)
        raise bad_request(f"{param}: not a valid JSON Schema: {exc.message}"
                          f"{f' (at {where})' if where else ''}", param) from None


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


class SamplingFields(RequestModel):
    """Sampling fields shared by chat and text completions (OpenAI ranges)."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # OpenAI's hint that requests sharing it share a prefix: they go to the same LanguageModel
    # replica while its load allows (`language_model.routing`); `user` serves when it is unset.
    prompt_cache_key: StrictStr | None = None
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
        if self.n > 1 and self.temperature == 0:
            raise bad_request("n: greedy sampling (temperature 0) gives one answer; set n to 1 or "
                              "a temperature above 0", "n")
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
    response_format: ResponseFormatParam | None = None
    # vLLM extension: a constraint (JSON schema, regex, choice, grammar, structural tag).
    structured_outputs: StructuredOutputs | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    # Mapped onto the chat template's thinking switch (vLLM's `enable_thinking`).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
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
        self._check_history()
        self._check_tools()
        if isinstance(self.response_format, JsonSchemaResponseFormat):
            schema = self.response_format.json_schema.schema_
            if schema is None:
                raise bad_request("response_format.json_schema.schema: required",
                                  "response_format.json_schema.schema")
            check_json_schema(schema, "response_format.json_schema.schema")
        if self.structured_outputs is not None and self.response_format is not None and \
                self.response_format.type != "text":
            raise bad_request("structured_outputs: send either it or response_format, not both",
                              "structured_outputs")
        return self

    def _check_history(self) -> None:
        """Each message's role fields; each tool message answers a call made before it."""
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            message.check(i)
            calls.update(c.id for c in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in calls:
                raise bad_request(f"messages[{i}].tool_call_id: {message.tool_call_id!r} matches "
                                  "no tool call of an earlier assistant message",
                                  f"messages[{i}].tool_call_id")

    def _check_tools(self) -> None:
        if self.tools is not None and not self.tools:
            raise bad_request("tools: must not be empty; leave it out instead", "tools")
        names = []
        for i, tool in enumerate(self.tools or ()):
            if tool.function.name in names:
                raise bad_request(f"tools[{i}].function.name: {tool.function.name!r} is already "
                                  "the name of another tool", f"tools[{i}].function.name")
            names.append(tool.function.name)
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice: needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise bad_request(f"tool_choice.function.name: no tool is named "
                              f"{self.tool_choice.function.name!r}", "tool_choice.function.name")

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` with tools, `none` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_kwargs(self) -> dict:
        """Variables for the chat template besides the messages, as vLLM's server passes them."""
        kwargs: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs["enable_thinking"] = self.reasoning_effort != "none"
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            choice = self.effective_tool_choice()
            kwargs["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        if self.response_format is not None:
            kwargs["response_format"] = self.response_format.model_dump(by_alias=True)
        return {**kwargs, **(self.chat_template_kwargs or {})}

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
    # With messages: the tools the chat template lists (they count toward the prompt).
    tools: list[ToolParam] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt: send exactly one of prompt and messages", "prompt")
        if self.tools is not None and self.messages is None:
            raise bad_request("tools: only with messages", "tools")
        for i, message in enumerate(self.messages or ()):
            message.check(i)
        check_template_kwargs(self.chat_template_kwargs)
        return self

    def template_kwargs(self) -> dict:
        """As a chat request with these tools passes them (`tool_choice` at its default)."""
        tools = {"tools": [t.model_dump(exclude_none=True) for t in self.tools],
                 "tool_choice": "auto"} if self.tools else {}
        return {**tools, **(self.chat_template_kwargs or {})}

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
    n: int = 1
    # Keyword arguments of vLLM's `StructuredOutputsParams` (JSON schema, structural tag for
    # tool calls, ...); None: unconstrained.
    structured_outputs: dict | None = None


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
    # vLLM's `reasoning_ended` for structured outputs (True: constrain from the first token;
    # None: the engine's reasoning parser decides from the prompt).
    reasoning_ended: bool | None = None
    # For routing to the replica that holds the prompt's prefix (pipeline/router/prefix_affinity):
    # each image's content hash, in prompt order, and the client's `prompt_cache_key` (or `user`).
    image_hashes: tuple[str, ...] = ()
    cache_key: str | None = None
    # vision.handover encoder_cache: where each image's encoder output is stored (`StoredEncoding`,
    # no tensor), fetched from there only by an LM whose node store lacks the image's entry.
    encoder_outputs: tuple = ()


@dataclass(frozen=True)
class ImageInfo:
    """ImagePreprocessor -> Router -> VisionEncoder: one preprocessed image.

    `pixel_values` is a Ray ObjectRef to a float32 array [num_patches, 3, 14, 14], so the pixels go
    from the preprocessor to the encoder through the object store without passing the router.
    With `vision.handover: encoder_cache` vLLM's processors patchify instead: `pixel_values` is
    None and `image` is an ObjectRef to the decoded RGB PIL image.
    """

    content_hash: str  # SHA-256 of the image bytes (the encoder cache key)
    grid_thw: tuple[int, int, int]  # in patches
    num_image_tokens: int  # after the 2x2 merge
    image_size: tuple[int, int]  # original (width, height)
    pixel_values: Any
    image: Any = None


@dataclass(frozen=True)
class StoredEncoding:
    """VisionEncoder -> Router -> LanguageModel with `vision.handover: encoder_cache`: the image's
    output [num_image_tokens, text hidden] is in `store` on the node `node_id`, under the key the
    image's uuid (`GenerateRequest.image_hashes`) hashes to (`ImageFormat.store_keys`). A
    LanguageModel on another node fetches it from there (`ec_store.fetch_from`); on the same
    node nothing moves."""

    num_image_tokens: int
    node_id: str
    store: str


# vLLM's server floors every logprob it returns here (`max(logprob, -9999.0)` in its chat and
# completion serving): a token a grammar masks has -inf, which no JSON encoder may write.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """`value` floored at `MIN_LOGPROB`; -inf and NaN become `MIN_LOGPROB` (issue 37)."""
    return max(value, MIN_LOGPROB) if math.isfinite(value) else MIN_LOGPROB


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token with its log-probability and the `top` alternatives (most likely
    first), as (token text, logprob) pairs. Logprobs are finite (`TokenLogprob.of`)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, token: str, logprob: float, top=()) -> TokenLogprob:
        """From the engine's values, every logprob through `finite_logprob`."""
        return cls(token, finite_logprob(logprob),
                   tuple((text, finite_logprob(value)) for text, value in top))


class GenerationDelta(msgspec.Struct, array_like=True):
    """One choice's text and tokens since its previous delta, as the Router's output processing
    makes them of the engine's outputs (`moonserve.pipeline.router.output_receiver`).

    When the response is written slower than the engine produces, deltas are merged
    (`merge_deltas`), so one delta may carry several tokens; `num_tokens` says how many.
    `logprobs` has one entry per token when the request asked for them. `index` is the choice
    (n > 1); `finished` marks the request's last delta (every choice done).
    """

    text: str
    num_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    token_ids: list[int] = msgspec.field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # of the prompt, from the engine's prefix cache
    num_cache_write_tokens: int = 0  # of the prompt, newly written to that cache
    stop_string: str | None = None  # the stop sequence that ended the choice


def merge_deltas(deltas: list[GenerationDelta]) -> list[GenerationDelta]:
    """One delta per choice, in order of first appearance: what a reader that fell behind sends
    as one event. Merged deltas keep every token, logprob and the last finish reason.

    Example:
        >>> merged = merge_deltas([GenerationDelta("a", 1, 5), GenerationDelta("b", 1, 5, "stop")])
        >>> merged[0].text, merged[0].num_tokens, merged[0].finish_reason
        ('ab', 2, 'stop')
    """
    if len(deltas) == 1:
        return deltas
    by_choice: dict[int, GenerationDelta] = {}
    for delta in deltas:
        into = by_choice.get(delta.index)
        if into is None:
            by_choice[delta.index] = msgspec.structs.replace(delta, token_ids=list(delta.token_ids))
            continue
        into.text += delta.text
        into.num_tokens += delta.num_tokens
        into.token_ids.extend(delta.token_ids)
        into.finish_reason = delta.finish_reason or into.finish_reason
        into.stop_string = delta.stop_string or into.stop_string
        into.finished = into.finished or delta.finished
        into.num_cached_tokens = max(into.num_cached_tokens, delta.num_cached_tokens)
        into.num_cache_write_tokens = max(into.num_cache_write_tokens,
                                          delta.num_cache_write_tokens)
        if delta.logprobs is not None:
            into.logprobs = [*(into.logprobs or []), *delta.logprobs]
    return list(by_choice.values())


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    # vLLM's tokenizer settings of the engine (the Router detokenizes with the same tokenizer).
    tokenizer: str = ""
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False


def sampling_spec(request: SamplingFields, max_tokens: int,
                  structured_outputs: dict | None = None,
                  skip_special_tokens: bool | None = None) -> SamplingSpec:
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
        skip_special_tokens=request.skip_special_tokens if skip_special_tokens is None
        else skip_special_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=request.num_logprobs(),
        n=request.n,
        structured_outputs=structured_outputs,
    )


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    cache_write_tokens: int = 0  # prompt tokens it wrote there

    def as_dict(self) -> dict:
        """OpenAI's usage, with the prompt tokens the engine's prefix cache held."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ChoiceOutput:
    """One choice's generation, accumulated from its deltas."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None

    def add(self, delta: GenerationDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_string = delta.stop_string or self.stop_string
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(delta.logprobs)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class Completion:
    """A finished generation (every choice), accumulated from deltas."""

    choices: dict[int, ChoiceOutput] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)

    def add(self, delta: GenerationDelta) -> ChoiceOutput:
        choice = self.choices.setdefault(delta.index, ChoiceOutput(delta.index))
        choice.add(delta)
        self.usage.prompt_tokens = delta.num_prompt_tokens
        self.usage.cached_tokens = max(self.usage.cached_tokens, delta.num_cached_tokens)
        self.usage.cache_write_tokens = max(self.usage.cache_write_tokens,
                                            delta.num_cache_write_tokens)
        self.usage.completion_tokens += delta.num_tokens
        return choice

    def in_order(self) -> list[ChoiceOutput]:
        return [self.choices[i] for i in sorted(self.choices)]
