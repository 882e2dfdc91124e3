"""Logprobs, vLLM's sampling extensions and /tokenize, /detokenize over real HTTP with the `openai`
client (logprobs against transformers: tests/smollm2/test_text.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL
from tests.payloads import data_url, image_chat, png

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_streamed_logprobs_equal_the_full_answer(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=10, logprobs=True,
                  top_logprobs=2)
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in full]


def test_no_logprobs_unless_asked(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert response.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         temperature=0, max_tokens=6, logprobs=2)
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob == max(top.values()) and len(top) == 2


def test_top_k_one_is_greedy(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a name for a ship."}],
                  max_tokens=12)
    greedy = client.chat.completions.create(**kwargs, temperature=0).choices[0].message.content
    for seed in (1, 2):
        sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=seed,
                                                 extra_body={"top_k": 1})
        assert sampled.choices[0].message.content == greedy


def test_stop_token_ids_and_min_tokens(client, tokenizer):
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0,
                                       max_tokens=8, logprobs=1)
    [first] = tokenizer.encode(greedy.choices[0].logprobs.tokens[0], add_special_tokens=False)
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0,
                                        max_tokens=8, extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    # min_tokens holds the stop token back for its first tokens.
    held = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0,
                                     max_tokens=8,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3 and held.choices[0].text != ""


def test_tokenize_counts_what_a_request_is_charged(client, server):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "messages": QUESTION,
                                                        "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
    assert len(body["token_strs"]) == body["count"] and body["max_model_len"] > body["count"]

    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           max_tokens=1)
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "The capital of France is"})
    assert r.json()["count"] == completion.usage.prompt_tokens

    r = httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"].endswith("The capital of France is")


def test_tokenize_counts_image_tokens(client, server):
    messages = image_chat(data_url(png((320, 200))))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "over"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_k": -2}, "top_k", "greater than or equal to -1"),
    ("/v1/chat/completions", {"messages": QUESTION, "min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("/v1/chat/completions", {"messages": QUESTION, "repetition_penalty": 0}, "repetition_penalty",
     "greater than 0"),
    ("/v1/chat/completions", {"messages": QUESTION, "stop_token_ids": ["a"]}, "stop_token_ids[0]",
     "valid integer"),
    ("/v1/chat/completions", {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs.tokenize", "cannot be overridden"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5, -1], "min_tokens": 1},
     "stop_token_ids[1]", "outside the vocabulary"),
    ("/tokenize", {"prompt": "hi", "messages": QUESTION}, "prompt", "exactly one"),
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]", "outside the vocabulary"),
])
def test_new_fields_are_validated_by_name(server, path, body, param, words):
    r = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
