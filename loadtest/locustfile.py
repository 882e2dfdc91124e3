"""Locust load test for moonserve's OpenAI API (streaming chat, multimodal chat, long context).

Every streamed request is reported three ways: the request itself (`POST chat [<lane>]`,
`POST chat+image [interactive]`), its time to first token (`TTFT <lane>`) and its inter-token
gaps (`ITL <lane>`), so Locust's tables, JSON, CSV and HTML reports show TTFT and ITL
percentiles per lane. A 429/503 answer is a failure named "rejected" with its Retry-After; a
stream the server cuts is a failure named "stream broke". The run's exit code is 1 when a
threshold fails (`--max-error-ratio`, `--max-ttft-p99-ms`, `--max-long-ttft-p99-ms`), so CI can
gate on it.

Headless, time-bounded (a load shape from loadtest/shapes.py is optional):

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s --stop-timeout 120 \\
        --host http://127.0.0.1:8000 --json-file out/run --html out/report.html \\
        --max-error-ratio 0.01 --max-ttft-p99-ms 2000
    locust -f loadtest/locustfile.py,loadtest/shapes.py --load-shape mixed -u 12 --shape-seconds 120 \\
        --headless --host http://127.0.0.1:8000 --json-file out/mixed

The final figures are in out/run.json, written once every user has stopped (a CSV from --csv is
rewritten every second or two and can miss the run's last requests).
"""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, events, task

from moonserve.pipeline.bench.corpus import data_url, encode, filler_text

CHAT_PROMPTS = ["What is the capital of France?", "Name three colors.",
                "Write one sentence about the sea.", "What is 2 + 2?", "Say hello in Spanish."]


@events.init_command_line_parser.add_listener
def add_options(parser):
    parser.add_argument("--model", default="moonserve-embedded", help="model name to request")
    parser.add_argument("--api-key", default="", env_var="MOONSERVE_API_KEY",
                        help="sent as Authorization: Bearer (when the server has auth on)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of chat requests")
    parser.add_argument("--long-context-fraction", type=float, default=0.75,
                        help="long-context prompts fill this fraction of the model's context")
    parser.add_argument("--long-context-users", type=int, default=0,
                        help="run exactly this many LongContextUser (0: by weight, 1 in 9)")
    parser.add_argument("--max-error-ratio", type=float, default=0.01,
                        help="fail the run (exit 1) when more than this fraction of requests "
                        "fail (TTFT/ITL entries not counted)")
    parser.add_argument("--max-ttft-p99-ms", type=float, default=0.0,
                        help="fail the run when interactive TTFT p99 exceeds this (0: no check)")
    parser.add_argument("--max-long-ttft-p99-ms", type=float, default=0.0,
                        help="fail the run when long_context TTFT p99 exceeds this (0: no check)")


@events.init.add_listener
def fix_long_context_users(environment, **kwargs):
    if environment.parsed_options and environment.parsed_options.long_context_users:
        LongContextUser.fixed_count = environment.parsed_options.long_context_users


class StreamingChatUser(HttpUser):
    """Base: POST a streaming chat completion and report the request, TTFT and ITL."""

    abstract = True
    wait_time = between(0.2, 1.0)
    lane = "interactive"  # the lane the server puts these requests in (TTFT/ITL rows by lane)
    label = "chat"

    hint: str | None = None  # x-moonserve-lane header, when the user asks for a lane

    def on_start(self):
        options = self.environment.parsed_options
        self.model = options.model
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        if self.hint:
            self.headers["x-moonserve-lane"] = self.hint

    def body(self) -> dict:
        raise NotImplementedError

    def stream_chat(self) -> None:
        body = {**self.body(), "model": self.model, "stream": True}
        began = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers,
                              stream=True, catch_response=True,
                              name=f"{self.label} [{self.lane}]") as response:
            if response.status_code != 200:
                response.failure(rejection(response))
                return
            try:
                error = self.read_stream(response, began)
            except (OSError, ValueError) as e:  # a cut stream (requests' errors are OSErrors)
                error = f"stream broke: {type(e).__name__}: {e}"
            if error:
                response.failure(error)

    def read_stream(self, response, began: float) -> str | None:
        """Report TTFT and ITL; a stream is complete once a choice has a finish_reason.

        The first generated token may be end-of-sequence (an empty answer with finish_reason
        "stop" is a valid completion), so TTFT is taken at the first chunk that carries content
        or a finish_reason."""
        last, finished = None, False
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error event: {event['error'].get('message')}"
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            finished = finished or bool(choice.get("finish_reason"))
            if not choice["delta"].get("content") and not (finished and last is None):
                continue
            now = time.perf_counter()
            kind, since = ("ITL", last) if last is not None else ("TTFT", began)
            events.request.fire(request_type=kind, name=self.lane, response_time=1000 * (now - since),
                                response_length=0, exception=None, context={})
            last = now
        return None if finished else "stream ended without a finish_reason"


def rejection(response) -> str:
    if response.status_code in (429, 503):
        return f"rejected ({response.status_code}, Retry-After {response.headers.get('Retry-After')})"
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


class InteractiveChat(StreamingChatUser):
    """Short chat turns: the interactive lane."""

    weight = 6

    def body(self) -> dict:
        prompt = random.choice(CHAT_PROMPTS)
        return {"messages": [{"role": "user", "content": prompt}], "temperature": 0.7,
                "max_tokens": self.environment.parsed_options.max_tokens}

    @task
    def chat(self):
        self.stream_chat()


class MultimodalChat(StreamingChatUser):
    """A chat turn with one Pillow-made image as a data URL (needs the image deployments)."""

    weight = 2
    label = "chat+image"

    def body(self) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": random_image_url()}},
            {"type": "text", "text": "Describe the picture."}]}],
            "max_tokens": self.environment.parsed_options.max_tokens}

    @task
    def chat(self):
        self.stream_chat()


class LongContextUser(StreamingChatUser):
    """Prompts near the context limit: the long_context lane."""

    weight = 1
    wait_time = between(1.0, 3.0)
    lane = hint = "long_context"  # the header makes the lane certain whatever the token count

    def on_start(self):
        super().on_start()
        models = self.client.get("/v1/models", headers=self.headers, name="models").json()
        max_len = models["data"][0]["max_model_len"]
        fraction = self.environment.parsed_options.long_context_fraction
        self.num_tokens = int(max_len * fraction)
        self.rng = random.Random()

    def body(self) -> dict:
        text = filler_text(self.rng, self.num_tokens)
        return {"messages": [{"role": "user", "content": "Summarize: " + text}], "max_tokens": 16}

    @task
    def chat(self):
        self.stream_chat()


def random_image_url(size: tuple[int, int] | None = None) -> str:
    from PIL import Image

    size = size or (random.randint(64, 640), random.randint(64, 640))
    image = Image.effect_mandelbrot(size, (-2.0, -1.2, 0.8, 1.2), random.randint(20, 100))
    return data_url(encode(image.convert("RGB"), "PNG"))


@events.quitting.add_listener
def check_thresholds(environment, **kwargs):
    """Exit code 1 when the run breaks a threshold; the reasons go to stderr."""
    options, stats = environment.parsed_options, environment.stats
    failures = []
    requests = [e for e in stats.entries.values() if e.method not in ("TTFT", "ITL")]
    num = sum(e.num_requests for e in requests)
    ratio = sum(e.num_failures for e in requests) / num if num else 0.0
    if ratio > options.max_error_ratio:
        failures.append(f"failure ratio {ratio:.4f} > {options.max_error_ratio}")
    for lane, limit in [("interactive", options.max_ttft_p99_ms),
                        ("long_context", options.max_long_ttft_p99_ms)]:
        entry = stats.entries.get((lane, "TTFT"))
        if limit and entry is not None and entry.num_requests:
            p99 = entry.get_response_time_percentile(0.99)
            if p99 > limit:
                failures.append(f"TTFT p99 {lane} {p99:.0f} ms > {limit:.0f} ms")
    # Set either way: Locust would otherwise exit 1 on any failure, ignoring the ratio.
    environment.process_exit_code = 1 if failures else 0
    for failure in failures:
        print(f"threshold failed: {failure}", flush=True)
