"""How the Locust file reads one SSE stream: what counts as a complete answer, what is reported.

Importing locust monkey-patches the process (gevent), so the locustfile runs in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
import json, sys
from locust import events
import locustfile

fired = []
events.request.add_listener(lambda request_type, name, **kw: fired.append(request_type))

class Response:
    def __init__(self, lines):
        self.lines = lines
    def iter_lines(self):
        return iter(line.encode() for line in self.lines)

user = object.__new__(locustfile.InteractiveChat)
error = user.read_stream(Response(json.loads(sys.argv[1])), 0.0)
print(json.dumps({"error": error, "fired": fired}))
"""


def chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {"content": content} if content is not None else {}
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2}})


def read_stream(lines: list[str]) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(lines)], capture_output=True,
                         text=True, timeout=60, cwd=REPO / "loadtest")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("lines, error, fired", [
    ([chunk(""), chunk("Hi"), chunk(" there"), chunk(finish="stop"), USAGE, "data: [DONE]"],
     None, ["TTFT", "ITL"]),
    # End-of-sequence as the first token: an empty answer is a complete one, with its TTFT.
    ([chunk(""), chunk(finish="stop"), USAGE, "data: [DONE]"], None, ["TTFT"]),
    # Cut before any finish_reason: a failure, whatever content came.
    ([chunk("Hi"), chunk(" there")], "stream ended without a finish_reason", ["TTFT", "ITL"]),
    ([chunk("Hi"), 'data: {"error": {"message": "engine died"}}'], "error event: engine died", ["TTFT"]),
])
def test_a_stream_is_complete_once_it_has_a_finish_reason(lines, error, fired):
    assert read_stream(lines) == {"error": error, "fired": fired}
