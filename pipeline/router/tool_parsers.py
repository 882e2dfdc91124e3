"""vLLM's tool parsers, with the one fix moonserve needs until vLLM ships it.

vLLM 0.32's `hermes` parser ends a call at the first `</tool_call>` in the text, even inside a
JSON string of the call's arguments (vLLM issue 45167; the fix, PR 55848, is not merged). The
grammar that holds a forced call (`tool_choice` required or named) lets a string hold any text,
so a sampled answer can be a complete, valid call that the parser cuts: `json.loads` fails and
the call is dropped, and a forced call answers 500 `tool_call_missing`. The soak
(`moonserve bench soak`, tests/server/test_soak.py) lost such requests: 1 in about 1,300 forced
calls on the embedded model, e.g. the answer
`<tool_call>\\n{"name": "get_weather", "arguments": {"city": "La Coruña,Espaial</tool_call-name>
</tool_call>,"}}\\n</tool_call>`.

`HermesToolParser` looks for the end tag outside the call's JSON strings, in whole answers and
in streams, and is otherwise vLLM's parser (`tests/unit/test_chat_parsing.py` checks vLLM's own
parser still cuts such a call: when it stops doing so, this module can go). Where it differs
besides: a whole answer whose last call is complete JSON followed by part of the end tag is that
call (as vLLM's streaming path reads it; vLLM's whole-answer path gives content); and a stream
whose call has an unbalanced quote (possible only where no grammar holds the call) runs on to
the end of the text instead of stopping at the next end tag.

Example:
    >>> parser_cls = with_fixed_tool_parser(ParserManager.get_parser(tool_parser_name="hermes",
    ...                                                               enable_auto_tools=True))
"""

from __future__ import annotations

import json
import logging

from vllm.entrypoints.generate.base.protocol import (
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.utils import is_complete_json, partial_tag_overlap

logger = logging.getLogger(__name__)


def tag_outside_strings(text: str, tag: str, start: int) -> int:
    """Index of the first `tag` at or after `start` that is not inside a JSON string literal
    (strings open at an unescaped `"`), or -1."""
    in_string, i = False, start
    while True:
        quote = text.find('"', i)
        if not in_string:
            found = text.find(tag, i, quote if quote != -1 else len(text))
            if found != -1:
                return found
            if quote == -1:
                return -1
        elif quote == -1:
            return -1
        else:
            backslashes = len(text[i:quote]) - len(text[i:quote].rstrip("\\"))
            if backslashes % 2:  # an escaped quote: the string goes on
                i = quote + 1
                continue
        in_string, i = not in_string, quote + 1


class HermesToolParser(Hermes2ProToolParser):
    """vLLM's `hermes` parser, ending each call at a `</tool_call>` outside its JSON strings."""

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        start = model_output.find(self.tool_call_start_token)
        if start == -1:
            return super().extract_tool_calls(model_output, request)
        try:
            calls = [json.loads(body) for body, _ in self._extract_tool_call_jsons(model_output)]
            tool_calls = [ToolCall(type="function", function=FunctionCall(
                name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)))
                for call in calls]
        except Exception as exc:  # noqa: BLE001 - as vLLM's parser: any failure is no call
            # The text as content (a malformed call under `auto`; nesting past json's recursion
            # limit raises RecursionError).
            logger.debug("no tool call parsed (%s): %r", exc, model_output[:500])
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                                content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=tool_calls,
                                            content=model_output[:start] or None)

    def _extract_tool_call_jsons(self, text: str) -> list[tuple[str, bool]]:
        """(json_text, is_complete) per `<tool_call>` region: vLLM's, with the end tag found
        outside the region's JSON strings."""
        results: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(self.tool_call_start_token, pos)) != -1:
            json_start = start + len(self.tool_call_start_token)
            json_end = tag_outside_strings(text, self.tool_call_end_token, json_start)
            if json_end != -1:
                results.append((text[json_start:json_end].strip(), True))
                pos = json_end + len(self.tool_call_end_token)
                continue
            raw = text[json_start:]
            overlap = partial_tag_overlap(raw, self.tool_call_end_token)
            body = (raw[:-overlap] if overlap else raw).strip()
            results.append((body, is_complete_json(body) if body else False))
            break
        return results


def with_fixed_tool_parser(parser_cls):
    """`parser_cls` (vLLM's composed parser, or None) with `HermesToolParser` where it would
    run vLLM's `Hermes2ProToolParser`; any other tool parser is left as it is."""
    if parser_cls is None or getattr(parser_cls, "tool_parser_cls", None) is not \
            Hermes2ProToolParser:
        return parser_cls
    return type(parser_cls.__name__, (parser_cls,), {"tool_parser_cls": HermesToolParser})
