"""Two LanguageModel replicas: a second app in the session's cluster (text only, speculation off).

- Prefix-affinity routing keeps each conversation on one replica: its first turn goes where
  Serve's power of two choices sends it, every later turn to the replica holding its prefix; the
  same for a Responses session continued by `previous_response_id`.
- Scaling the LanguageModel from two replicas to one under load, with Ray's own scale call (the
  dashboard's REST API; the app runs with `external_scaler_enabled`), cuts no stream: the
  replica that goes drains, the other keeps serving, nothing is restarted.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from moonserve.pipeline.bench.corpus import filler_text
from moonserve.pipeline.bench.routing import replica_stats
from moonserve.pipeline.config import DEFAULT_CONFIG, AppConfig
from tests.conftest import MODEL
from tests.server.conftest import DASHBOARD_PORT

APP = "replicas"
STREAMS = 4
STREAM_TOKENS = 420  # at 4 streams on 2 cores, long enough to outlast Serve's default 20 s drain


@pytest.fixture(scope="module")
def replicas(server):
    from ray import serve

    from moonserve.deployments.builder import build_app

    args = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    args["vision"] = None
    args["draft"] = {"mode": "off"}
    lm = args["language_model"]
    lm["deployment"] = {"num_replicas": 2, "max_ongoing_requests": 64}
    # The session's engine holds one of the cluster's two CPUs: these two take a sliver each and
    # run one unbound OpenMP thread, so they do not bind the same core.
    lm["placement"] = {"bundles": [{"CPU": 0.01}], "strategy": "STRICT_PACK"}
    lm["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    server.lm_handle()  # joins the session's cluster
    serve.run(build_app(AppConfig.model_validate(args)), name=APP, route_prefix=f"/{APP}",
              external_scaler_enabled=True)
    try:
        yield f"{server.base_url}/{APP}", serve.get_deployment_handle("LanguageModel",
                                                                      app_name=APP)
    finally:
        serve.delete(APP)


def requests_by_replica(handle, replicas: int = 2) -> dict[str, int]:
    return {name: stats["num_requests"]
            for name, stats in replica_stats(handle, replicas).items()}


async def test_each_conversation_stays_on_the_replica_holding_its_prefix(replicas):
    url, handle = replicas
    rng = random.Random(3)
    async with httpx.AsyncClient(timeout=300) as http:
        for k in range(4):
            before = await asyncio.to_thread(requests_by_replica, handle)
            messages = [{"role": "system",
                         "content": f"Conversation {k}. {filler_text(rng, 150)}"}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn}: why?"})
                r = await http.post(f"{url}/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                messages.append({"role": "assistant",
                                 "content": r.json()["choices"][0]["message"]["content"]})
            after = await asyncio.to_thread(requests_by_replica, handle)
            # Power of two choices alone keeps all three together one time in four.
            assert sorted(after[name] - before.get(name, 0) for name in after) == [0, 3], k


async def test_each_responses_session_stays_on_one_replica(replicas):
    """Turns that continue by `previous_response_id` send only their new input: the Router
    rebuilds the conversation from the store and routes it by its prefix (and by the session's
    key), so every turn of a session lands on one replica."""
    url, handle = replicas
    rng = random.Random(5)
    async with httpx.AsyncClient(timeout=300) as http:
        for k in range(3):
            before = await asyncio.to_thread(requests_by_replica, handle)
            previous = None
            for turn in range(3):
                body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0,
                        "input": f"Session {k}. {filler_text(rng, 150)}" if turn == 0
                        else f"Question {turn}: why?"}
                if previous is not None:
                    body["previous_response_id"] = previous
                r = await http.post(f"{url}/v1/responses", json=body)
                assert r.status_code == 200, r.text
                previous = r.json()["id"]
            after = await asyncio.to_thread(requests_by_replica, handle)
            assert sorted(after[name] - before.get(name, 0) for name in after) == [0, 3], k


def dashboard_headers() -> dict[str, str]:
    """Ray's token, when its token authentication is on (`ray get-auth-token`)."""
    ray_cli = Path(sys.executable).with_name("ray")
    token = subprocess.run([str(ray_cli), "get-auth-token"], capture_output=True, text=True)
    return {"Authorization": f"Bearer {token.stdout.strip()}"} \
        if token.returncode == 0 and token.stdout.strip() else {}


async def stream(http: httpx.AsyncClient, url: str, k: int, started: asyncio.Event) -> tuple:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story {k}."}],
            "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens, done = 0, False
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                started.set()
                if usage := json.loads(line[6:]).get("usage"):
                    tokens = usage["completion_tokens"]
    return r.status_code, tokens, done


async def test_scaling_the_language_model_down_under_load_cuts_no_stream(replicas):
    from ray import serve

    url, handle = replicas
    async with httpx.AsyncClient(timeout=600) as http:
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream(http, url, k, e)) for k, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 180)
        running = await asyncio.to_thread(replica_stats, handle, 2)
        assert all(s["num_unfinished_requests"] > 0 for s in running.values()), running
        scaled = time.monotonic()
        r = await http.post(f"http://127.0.0.1:{DASHBOARD_PORT}/api/v1/applications/{APP}/"
                            "deployments/LanguageModel/scale",
                            json={"target_num_replicas": 1}, headers=dashboard_headers())
        assert r.status_code == 200, r.text
        during = await http.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        results = await asyncio.gather(*streams)
        drained_s = time.monotonic() - scaled
    assert results == [(200, STREAM_TOKENS, True)] * STREAMS
    assert during.status_code == 200, during.text
    assert drained_s > 20, drained_s  # past Serve's default graceful shutdown
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replica_states = serve.status().applications[APP].deployments["LanguageModel"] \
            .replica_states
        states = {getattr(state, "value", state): n for state, n in replica_states.items()}
        if states == {"RUNNING": 1}:
            break
        await asyncio.sleep(1)
    assert states == {"RUNNING": 1}, states
