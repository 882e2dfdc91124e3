"""API keys and per-request limits: unit tests, then a secured Router bound to the session server.

The secured Router runs in this process (`RunningServer.router_here`: Router-only settings),
bound to the session server's LanguageModel deployment (no second engine): auth on, small limits;
the rate-limited one uses a RateLimiter deployed on the session server's cluster.
"""

from __future__ import annotations

import time

import httpx
import pytest

from moonserve.deployments.builder import resolve_api_keys
from moonserve.pipeline.api.auth import ApiKeys
from moonserve.pipeline.config import RouterConfig
from moonserve.pipeline.api.errors import APIError
from tests.conftest import MODEL

KEY = "sk-test-9f2c1e"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Basic " + KEY, KEY,
                                    "Bearer sk-wrong", "Bearer " + KEY + "x"])
def test_rejected_authorization_headers(header):
    with pytest.raises(APIError) as err:
        ApiKeys.from_plaintext([KEY, "sk-other"]).check(header)
    assert err.value.status == 401 and err.value.type == "authentication_error"
    assert KEY not in err.value.message


@pytest.mark.parametrize("header", ["Bearer " + KEY, "bearer " + KEY, "Bearer sk-other"])
def test_accepted_authorization_headers(header):
    ApiKeys.from_plaintext([KEY, "sk-other"]).check(header)


def test_keys_come_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("TEST_KEYS", "sk-env-1, sk-env-2")
    config = RouterConfig.model_validate({"auth": {"api_keys": ["sk-cfg"], "api_keys_env": "TEST_KEYS"}})
    keys = resolve_api_keys(config)
    for key in ("sk-cfg", "sk-env-1", "sk-env-2"):
        keys.check(f"Bearer {key}")
    assert "sk-cfg" not in repr(config)  # SecretStr: never printed


def test_auth_enabled_without_keys_fails_at_build(monkeypatch):
    monkeypatch.delenv("MOONSERVE_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="MOONSERVE_API_KEYS"):
        resolve_api_keys(RouterConfig())
    assert resolve_api_keys(RouterConfig.model_validate({"auth": {"enabled": False}})) is None


SECURED_LIMITS = {"max_request_bytes": 4096, "max_messages": 3, "max_message_chars": 200,
                  "max_tokens": 16}


@pytest.fixture(scope="module")
def secured(server):
    with server.router_here(auth={"enabled": True, "api_keys": [KEY]},
                           limits=SECURED_LIMITS) as url:
        yield url


def post(url: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def chat(content="hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            **fields}


def test_secured_app_answers_with_a_key(secured):
    r = post(secured, chat())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_secured_app_refuses_without_a_valid_key(secured, key):
    r = post(secured, chat(), key=key)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text
    assert httpx.get(f"{secured}/v1/models", timeout=10).status_code == 401


def test_auth_is_checked_before_the_body_is_read(secured):
    r = post(secured, chat(content="x" * 10_000), key=None)
    assert r.status_code == 401  # not 413: unauthenticated clients learn nothing about limits


def test_health_stays_open(secured):
    assert httpx.get(f"{secured}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("body,status,param", [
    (chat(content="x" * 5000), 413, None),
    (chat(content="x" * 201), 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 4}, 400, "messages"),
    (chat(max_tokens=17), 400, "max_tokens"),
    ({**chat(), "max_tokens": None, "max_completion_tokens": 17}, 400, "max_completion_tokens"),
])
def test_limits_are_enforced_naming_the_field(secured, body, status, param):
    r = post(secured, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# Rate limits: one app-wide RateLimiter; each key its own buckets. 0.5 requests/s holds one
# request per 2 s; 20 tokens/min is less than one request's prompt and completion.
OTHER_KEY = "sk-test-77ab01"
RATE_LIMITS = {"requests_per_s": 0.5, "tokens_per_min": 20}


@pytest.fixture(scope="module")
def limited(server):
    with server.router_here(auth={"enabled": True, "api_keys": [KEY, OTHER_KEY]},
                           rate_limits=RATE_LIMITS) as url:
        yield url


def tokenize(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hi"},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_a_key_over_its_request_rate_gets_429_with_retry_after(limited):
    assert tokenize(limited, KEY).status_code == 200
    r = tokenize(limited, KEY)  # within 2 s of the first
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] in ("1", "2")
    error = r.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "requests_per_s" in error["message"]
    assert KEY not in r.text
    assert tokenize(limited, OTHER_KEY).status_code == 200  # another key is not held back
    time.sleep(int(r.headers["retry-after"]))
    assert tokenize(limited, KEY).status_code == 200


def test_a_key_over_its_tokens_waits_for_them(limited):
    time.sleep(2.1)  # the request bucket refilled
    first = post(limited, chat(), key=OTHER_KEY)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert used > RATE_LIMITS["tokens_per_min"]
    time.sleep(2.1)
    r = post(limited, chat(), key=OTHER_KEY)
    assert r.status_code == 429, r.text
    assert "tokens_per_min" in r.json()["error"]["message"]
    # In debt by used - 20 tokens, refilled at 20 per minute since the first request ended.
    assert int(r.headers["retry-after"]) == pytest.approx((used - 20) * 3 - 2.1 * 1, abs=3)
