"""Request validation and mapping, without Ray or an engine."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from moonserve.pipeline.api.errors import APIError, format_loc, from_validation_error
from moonserve.pipeline.api.prompt import resolve_max_tokens
from moonserve.pipeline.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationDelta,
    ModelInfo,
    SamplingSpec,
    sampling_spec,
)
from moonserve.pipeline.api.streaming import DONE, ResponseFormat, StreamEncoder

INFO = ModelInfo(name="m", max_model_len=100, vocab_size=1000)


def parse(body: dict, model=ChatCompletionRequest):
    try:
        return model.model_validate_json(json.dumps(body))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def test_openai_defaults_map_to_sampling_spec():
    req = parse({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert sampling_spec(req, 7) == SamplingSpec(max_tokens=7, temperature=1.0, top_p=1.0)


def test_all_sampling_fields_are_carried():
    req = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0,
                 "top_p": 0.5, "stop": "END", "seed": 3, "presence_penalty": 1,
                 "frequency_penalty": -1})
    spec = sampling_spec(req, 5)
    assert (spec.temperature, spec.top_p, spec.stop, spec.seed) == (0, 0.5, ("END",), 3)
    assert (spec.presence_penalty, spec.frequency_penalty) == (1, -1)


def test_max_completion_tokens_wins_over_max_tokens():
    req = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                 "max_completion_tokens": 4})
    assert req.requested_max_tokens() == 4


def test_text_parts_join_with_newlines():
    req = parse({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "a\nb"


@pytest.mark.parametrize("loc,param", [
    (("messages", 0, "content"), "messages[0].content"),
    (("stop", 2), "stop[2]"),
    (("model",), "model"),
])
def test_format_loc(loc, param):
    assert format_loc(loc) == param


def test_union_errors_point_at_the_deepest_field():
    with pytest.raises(APIError) as err:
        parse({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": None}]}]})
    assert err.value.param == "messages[0].content[1].text"


def test_completion_prompt_accepts_string_or_token_ids():
    assert parse({"model": "m", "prompt": "hi"}, CompletionRequest).prompt == "hi"
    assert parse({"model": "m", "prompt": [1, 2]}, CompletionRequest).prompt == [1, 2]


@pytest.mark.parametrize("prompt_len,requested,expected", [
    (10, None, 90), (10, 90, 90), (10, 5, 5), (99, None, 1),
])
def test_resolve_max_tokens_fills_the_context(prompt_len, requested, expected):
    assert resolve_max_tokens(prompt_len, requested, INFO, "messages", None) == expected


def test_resolve_max_tokens_default_cap():
    assert resolve_max_tokens(10, None, INFO, "messages", cap=16) == 16


@pytest.mark.parametrize("prompt_len,requested,param", [(100, None, "messages"), (150, 1, "messages"),
                                                        (10, 91, "max_tokens")])
def test_resolve_max_tokens_rejects_overflow(prompt_len, requested, param):
    with pytest.raises(APIError) as err:
        resolve_max_tokens(prompt_len, requested, INFO, "messages", None)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.code == "context_length_exceeded"


def events(data: bytes) -> list:
    return [json.loads(e[6:]) for e in data.decode().split("\n\n") if e and e != "data: [DONE]"]


def test_stream_encoder_chat_chunks_and_usage():
    enc = StreamEncoder(ResponseFormat("id1", "m", chat=True), include_usage=True)
    out = enc.opening()
    out += enc.encode(GenerationDelta("Hel", 1, 5))
    out += enc.encode(GenerationDelta("lo", 2, 5, "stop"))
    out += enc.closing()
    assert out.endswith(DONE)
    first, a, b, usage = events(out)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert a["choices"][0]["delta"] == {"content": "Hel"}
    assert b["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_encoder_skips_empty_deltas_and_omits_usage_unless_asked():
    enc = StreamEncoder(ResponseFormat("id1", "m", chat=False), include_usage=False)
    assert enc.opening() == b""
    assert enc.encode(GenerationDelta("", 0, 5)) == b""
    assert enc.closing() == DONE


def test_full_response_shapes():
    enc = StreamEncoder(ResponseFormat("id1", "m", chat=True), include_usage=False)
    enc.encode(GenerationDelta("Paris.", 3, 5, "stop"))
    body = enc.fmt.full(enc.completion)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Paris."
    assert body["usage"]["total_tokens"] == 8
