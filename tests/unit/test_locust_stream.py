"""How the Locust file reads one SSE stream: what counts as a complete answer, what is reported,
and a stream cut by the server (a real socket) counted as a failed request.

Importing locust monkey-patches the process (gevent), so the locustfile runs in a subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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


class CutStream(BaseHTTPRequestHandler):
    """Answers every chat request with a 200 stream that stops after one chunk: the socket
    closes before the chunked body's end, as when a server process dies mid-answer."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = (chunk("Hi") + "\n\n").encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_a_stream_the_server_cuts_is_a_failed_request_not_a_missing_one():
    server = ThreadingHTTPServer(("127.0.0.1", 0), CutStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = subprocess.run(
            [str(Path(sys.executable).with_name("locust")), "-f", "loadtest/locustfile.py",
             "--headless", "-u", "1", "-r", "1", "-t", "3s", "--only-summary",
             "--host", f"http://127.0.0.1:{server.server_port}", "InteractiveChat"],
            capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        server.shutdown()
    # Locust's summary (stderr): every request a failure, each with the reason.
    row = re.search(r"POST +chat \[interactive\] +(\d+) +(\d+)\(100\.00%\)", run.stderr)
    assert row and int(row[1]) == int(row[2]) > 0, run.stderr[-3000:]
    reported = re.search(r"(\d+) +POST chat \[interactive\]: stream broke: ChunkedEncodingError",
                         run.stderr)
    assert reported and reported[1] == row[1], run.stderr[-3000:]
    assert run.returncode == 1  # over --max-error-ratio's default 0.01
