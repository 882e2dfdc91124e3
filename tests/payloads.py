"""Request parts the live tests of tests/server and tests/smollm2 share: images made with Pillow,
function tools with their JSON Schemas, and a streamed tool call put together as a client does."""

from __future__ import annotations

from PIL import Image

from moonserve.pipeline.bench.corpus import data_url, encode

__all__ = ["ANTHROPIC_GREEDY", "ANTHROPIC_TOOLS", "ASK", "COPY_PROMPT", "FUNCTIONS", "NAMED", "SCHEMAS", "TOOLS", "chat_ids",
           "anthropic_prompt_tokens", "data_url", "image_chat", "png", "reassemble"]

# Two copies of a line, then its start: the n-gram drafter proposes the copy.
COPY_PROMPT = "river stone lantern orbit velvet harbor copper meadow\n" * 2 + "river stone"

# Today's Anthropic SDK has no sampling arguments; the API still reads `temperature`.
ANTHROPIC_GREEDY = {"extra_body": {"temperature": 0}}


def anthropic_prompt_tokens(usage) -> int:
    """Anthropic's three parts of the prompt: the rest, read from the cache, written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def png(size=(224, 224), color=(200, 30, 30), mode="RGB") -> bytes:
    return encode(Image.new(mode, size, color), "PNG")


def image_chat(*urls: str, text="Describe the picture.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat_ids(tokenizer, content: str) -> list[int]:
    """The token ids of one user turn as the chat template renders it for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string"}},
               "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "Current time in a timezone",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
# The same tools as Anthropic's Messages API and OpenAI's Responses API take them.
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def reassemble(chunks) -> tuple[dict[int, dict], str | None]:
    """OpenAI's streamed tool calls put together as a client does: per index, id and name once,
    then the arguments in pieces."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None, "the id is sent once"
                call["id"] = piece.id
            if piece.function and piece.function.name:
                assert call["name"] is None, "the name is sent once"
                call["name"] = piece.function.name
            if piece.function and piece.function.arguments:
                call["arguments"] += piece.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish
