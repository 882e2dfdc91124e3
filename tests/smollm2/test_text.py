"""SmolLM2's own text through the running app: greedy output equal to transformers' `generate`
on the same checkpoint, a known answer, a counting continuation cut by stop strings, and logprobs
equal to transformers' softmax. Real HTTP, the real `openai` client, the real vLLM engine."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import MODEL
from tests.payloads import chat_ids

EQUIVALENCE_PROMPTS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the moon.",
    "What is 2 plus 2?",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def transformers_greedy(reference_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, tokenizer = reference_model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("prompt", EQUIVALENCE_PROMPTS)
def test_chat_greedy_equals_transformers_generate(client, reference_model, prompt):
    _, tokenizer = reference_model
    prompt_ids = chat_ids(tokenizer, prompt)
    expected = transformers_greedy(reference_model, prompt_ids, max_new_tokens=24)

    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=24)

    assert response.choices[0].message.content == \
        tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected)


def test_completion_from_token_ids_equals_transformers(client, reference_model):
    _, tokenizer = reference_model
    prompt_ids = tokenizer.encode("The capital of France is")
    expected = transformers_greedy(reference_model, prompt_ids, max_new_tokens=12)

    response = client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0,
                                         max_tokens=12)

    assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.completion_tokens == len(expected)


def test_capital_of_france(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                              max_tokens=16)
    assert response.choices[0].message.content == "The capital of France is Paris."
    assert response.choices[0].finish_reason == "stop"


def test_stop_sequence_ends_generation(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0,
                                     max_tokens=16)
    text = full.choices[0].text
    assert "7" in text, f"greedy continuation should count on: {text!r}"
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0,
                                        max_tokens=16, stop=["7"])
    assert stopped.choices[0].text == text[: text.index("7")]
    assert stopped.choices[0].finish_reason == "stop"
    with_stop = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=16, stop=["7"],
        extra_body={"include_stop_str_in_output": True}).choices[0].text
    assert with_stop == stopped.choices[0].text + "7"


def transformers_logprobs(reference_model, prompt_ids: list[int],
                          generated: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at each generated position, [len(generated), vocab]."""
    model, _ = reference_model
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].float(), dim=-1)


def test_chat_logprobs_match_transformers(client, reference_model):
    _, tokenizer = reference_model
    # 5 tokens: "The capital of France is", before the answer's end-of-sequence token.
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                              max_tokens=5, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    text = response.choices[0].message.content
    assert len(content) == response.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == text
    generated = tokenizer.encode(text, add_special_tokens=False)
    expected = transformers_logprobs(reference_model, chat_ids(tokenizer, QUESTION[0]["content"]),
                                     generated)
    for position, entry in enumerate(content):
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == tops[0]
        assert entry.bytes == list(entry.token.encode())
        want = expected[position].topk(3).values.tolist()
        assert tops == pytest.approx(want, abs=0.05), position
