"""Replica faults, for real: replica processes are SIGKILLed.

LanguageModel killed mid-stream: in-flight streams end promptly with an error event (not hang),
Serve brings a new replica up, and new requests succeed. ImagePreprocessor or VisionEncoder
killed: text requests are unaffected, image requests fail fast with 503 or succeed, and succeed
again once Serve has replaced the replica. Marked `destructive`: conftest runs these tests last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.conftest import MODEL
from tests.payloads import data_url, image_chat, png
from tests.serving import wait_gone

pytestmark = pytest.mark.destructive


def replica_process(server, deployment: str) -> psutil.Process:
    title = f"ray::ServeReplica:moonserve:{deployment}"
    for process in server.process.descendants():
        try:
            if process.cmdline() and process.cmdline()[0].startswith(title):
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no {deployment} replica process among the server's descendants")


def language_model_replica(server) -> psutil.Process:
    return replica_process(server, "LanguageModel")


class StreamReader(threading.Thread):
    """Reads one long SSE stream; records its events and when it ended."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.events: list[str] = []
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.status: int | None = None

    def run(self):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(60, read=60)) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:
                    self.events.append(line)
                if len(self.events) >= 3:
                    self.started.set()
        self.ended_at = time.monotonic()


def wait_until_serving(base_url: str, timeout_s: float) -> float:
    began = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    while time.monotonic() - began < timeout_s:
        try:
            if httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"not serving again {timeout_s}s after the replica was killed")


def test_killed_language_model_replica_ends_streams_and_recovers(server):
    readers = [StreamReader(server.base_url) for _ in range(2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.started.wait(60), "streams did not start"

    replica = language_model_replica(server)
    engine_processes = replica.children(recursive=True)
    assert engine_processes, "the replica should own vLLM's engine processes"
    killed_at = time.monotonic()
    os.kill(replica.pid, signal.SIGKILL)

    for reader in readers:
        reader.join(30)
        assert not reader.is_alive(), "a stream hung after its replica died"
        assert reader.status == 200 and reader.events[-1] == "data: [DONE]"
        error = json.loads(reader.events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "replica_unavailable", error
        assert reader.ended_at - killed_at < 30

    left = wait_gone(engine_processes, timeout_s=30)
    assert not left, f"the killed replica's engine processes outlived it: {left}"

    recovery_s = wait_until_serving(server.base_url, timeout_s=240)
    print(f"\nLanguageModel replica killed; serving again after {recovery_s:.1f} s")
    assert language_model_replica(server).pid != replica.pid
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def image_request(base_url: str, seed: int) -> httpx.Response:
    body = {"model": MODEL, "messages": image_chat(data_url(png((56 + seed % 50, 56), (seed % 256, 0, 0)))),
            "max_tokens": 2}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("deployment", ["VisionEncoder", "ImagePreprocessor"])
def test_killed_image_replica_spares_text_and_image_requests_recover(server, deployment):
    text = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    replica = replica_process(server, deployment)
    os.kill(replica.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for _ in range(3):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=text, timeout=30)
        assert r.status_code == 200, r.text
    statuses = []
    seed = 0
    while time.monotonic() - killed_at < 180:
        seed += 1
        began = time.monotonic()
        r = image_request(server.base_url, seed)
        statuses.append(r.status_code)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert time.monotonic() - began < 10, "an image request hung on the dead replica"
            assert "retry-after" in r.headers
        if r.status_code == 200 and time.monotonic() - killed_at > 1:
            break
        time.sleep(0.5)
    assert statuses[-1] == 200, f"image requests did not recover: {statuses}"
    print(f"\n{deployment} killed; image requests {statuses}, serving again after "
          f"{time.monotonic() - killed_at:.1f} s")


def greedy_stream_text(base_url: str, body: dict, progress: threading.Event) -> str:
    parts = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=httpx.Timeout(60, read=60)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                parts.append(event["choices"][0]["delta"]["content"])
                if len(parts) >= 8:
                    progress.set()
    return "".join(parts)


def test_killed_draft_service_costs_speculation_not_tokens(server):
    from concurrent.futures import ThreadPoolExecutor

    from moonserve.pipeline.bench.corpus import copy_prompts
    from tests.serving import scrape

    body = {"model": MODEL, "messages": [{"role": "user", "content": copy_prompts(1, seed=9)[0]}],
            "max_tokens": 160, "ignore_eos": True, "temperature": 0}
    with server.drafter("none"):
        reference = httpx.post(f"{server.base_url}/v1/chat/completions", json=body,
                               timeout=120).json()["choices"][0]["message"]["content"]

    progress = threading.Event()
    # Paced at 100 ms a step, the stream outlives the kill by seconds (the tiny model's own steps
    # would end it first).
    with ThreadPoolExecutor(1) as pool, server.paced(0.1):
        stream = pool.submit(greedy_stream_text, server.base_url, body, progress)
        assert progress.wait(60), "the stream did not start"
        os.kill(replica_process(server, "DraftService").pid, signal.SIGKILL)
        killed_at = time.monotonic()
        text = stream.result(timeout=120)
    assert text == reference, "tokens changed when the DraftService died mid-stream"

    # Speculation resumes once Serve has replaced the replica (its sessions start empty).
    short = {**body, "max_tokens": 24}
    while True:
        accepted = server.spec_counters()[1]
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=short, timeout=60)
        assert r.status_code == 200, r.text
        if server.spec_counters()[1] > accepted:
            break
        assert time.monotonic() - killed_at < 180, "speculation did not resume"
        time.sleep(1)
    print(f"\nDraftService killed mid-stream: tokens unchanged; drafting again after "
          f"{time.monotonic() - killed_at:.1f} s")
    deadline = time.monotonic() + 60
    while scrape(server.metrics_url).get("ray_moonserve_draft_fallbacks_total", 0) <= 0:
        assert time.monotonic() < deadline, "no moonserve_draft_fallbacks exported"
        time.sleep(3)
