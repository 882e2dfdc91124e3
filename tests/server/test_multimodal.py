"""Images through the running app: Router -> ImagePreprocessor -> VisionEncoder -> LanguageModel.

Images are made with Pillow and sent as data URLs by the real `openai` client. The embedded
encoder's weights are random, so these tests check the path (counts, caching, errors, streaming,
determinism), not what the model says about the picture.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from moonserve.pipeline.bench.corpus import broken_images, odd_images
from moonserve.pipeline.vision.preprocess import navit_grid, num_image_tokens
from tests.conftest import MODEL
from tests.payloads import data_url, image_chat, png


def expected_tokens(size) -> int:
    return num_image_tokens(navit_grid(*size))


def encoder_stats(server) -> dict:
    from ray import serve

    server.lm_handle()  # joins the cluster
    return serve.get_deployment_handle("VisionEncoder", app_name="moonserve").stats.remote().result(timeout_s=60)


def test_image_tokens_count_in_usage_and_the_answer_is_deterministic(client):
    small, large = (224, 224), (448, 336)
    answers = []
    for size in (small, large, small):
        r = client.chat.completions.create(model=MODEL, messages=image_chat(data_url(png(size))),
                                           max_tokens=8, temperature=0)
        answers.append((r.usage.prompt_tokens, r.choices[0].message.content))
    assert answers[1][0] - answers[0][0] == expected_tokens(large) - expected_tokens(small)
    assert answers[0][0] > expected_tokens(small)
    assert answers[0] == answers[2], "same image, same greedy answer"
    assert answers[0][1]


def test_two_images_in_one_message_and_streaming(client):
    urls = [data_url(png((224, 224), (0, 0, 255))), data_url(png((112, 140), (0, 255, 0)))]
    one = client.chat.completions.create(model=MODEL, messages=image_chat(urls[0]), max_tokens=4)
    stream = client.chat.completions.create(model=MODEL, messages=image_chat(*urls), max_tokens=4,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    # The second image adds its tokens plus the newline that separates the two parts.
    assert usage.prompt_tokens - one.usage.prompt_tokens == expected_tokens((112, 140)) + 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_same_image_is_encoded_once(server, client):
    url = data_url(png((280, 280), (17, 99, 3)))
    before = encoder_stats(server)
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=image_chat(url), max_tokens=2)
    after = encoder_stats(server)
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] == 2


BROKEN = broken_images()
ODD = odd_images()


@pytest.mark.parametrize("name", list(BROKEN))
def test_bad_images_are_400_naming_message_and_part(client, name):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": BROKEN[name]}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    error = err.value.body
    assert error["param"] == "messages[1].content[1]", error
    assert error["message"].startswith("messages[1].content[1]: ")


@pytest.mark.parametrize("name", list(ODD))
def test_odd_but_valid_images_are_answered(client, name):
    r = client.chat.completions.create(model=MODEL, messages=image_chat(ODD[name]), max_tokens=2)
    assert r.choices[0].finish_reason and r.usage.prompt_tokens > 1


def test_bad_images_leave_the_image_replicas_healthy(server, client):
    for url in BROKEN.values():
        httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": image_chat(url), "max_tokens": 2})
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=image_chat(data_url(png())),
                                       max_tokens=2)
    assert r.choices[0].finish_reason


def test_too_many_images_and_images_outside_user_messages(client):
    url = data_url(png((28, 28)))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=image_chat(*[url] * 9), max_tokens=2)
    assert err.value.body["code"] == "too_many_images"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert err.value.body["param"] == "messages[1].content[0]"
