"""Replica faults, for real: the LanguageModel replica process is SIGKILLed mid-stream.

In-flight streams must end promptly with an error event (not hang), non-streaming requests get a
503 with Retry-After, Serve brings a new replica up, and new requests succeed. Marked `destructive`:
conftest runs these tests last, since they restart the session server's engine.
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

from tests.conftest import MODEL, wait_gone

pytestmark = pytest.mark.destructive
LM_PROCESS_TITLE = "ray::ServeReplica:moonserve:LanguageModel"


def language_model_replica(server) -> psutil.Process:
    for process in server.process.descendants():
        try:
            if process.cmdline() and process.cmdline()[0].startswith(LM_PROCESS_TITLE):
                return process
        except psutil.Error:
            continue
    raise AssertionError("no LanguageModel replica process among the server's descendants")


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
