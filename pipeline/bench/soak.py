"""Soak: mixed traffic at a steady load for a long time; memory stays flat and nothing is lost.

Starts `moonserve serve` on `--config` and runs `--concurrency` closed-loop clients for
`--duration-s` (default 20 minutes). Each client takes its next request's kind from a dealt deck
(KINDS, by weight): whole and streamed chat, an image (a PNG made with Pillow: from a pool of
IMAGE_POOL, or a small new one), a forced tool call, a stream the client hangs up on after its
first token, a long prompt (the long-context lane), and a bad request (a malformed body or a
broken image, pipeline/bench/corpus.py). Every `--sample-s` it records each server process's RSS
(psutil, the whole process tree: Ray's daemons, the replicas, vLLM's engine cores) and the bytes
in Ray's object store (the node's `ray_object_store_memory` metric). After the load, the object
store is polled until it is back to its level before the load (`--settle-s` at most).

Goals (exit status 1 when one fails):
- after `--warmup-s`, no process's RSS grows more than 10% (its sample at the end of the warm-up
  against its last sample under load);
- the object store returns to its level before the load once the load stops;
- 0 requests lost (no answer, a short or cut stream, an error event), 0 unexpected 5xx (a 503 with
  Retry-After is a refusal, not a loss), and every bad request answered with a 4xx.

    moonserve bench soak [--duration-s 1200] [--concurrency 4] [--out bench-soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

import aiohttp
import psutil
from PIL import Image

from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.bench.corpus import bad_bodies, broken_images, data_url, encode, filler_text
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config

MAX_RSS_GROWTH = 0.10
STORE_LOCATIONS = ("MMAP_SHM", "MMAP_DISK", "SPILLED")  # not WORKER_HEAP: in-process objects
STORE_REPORT_S = 2 * 10.0  # two of the raylet's metric reports (Ray's metrics_report_interval_ms)
# The mix: kind -> weight. "long" prompts pass the default long_context_threshold_tokens (1024).
KINDS = {"chat": 3, "stream": 4, "image": 2, "tool": 2, "cancel": 2, "long": 1, "bad": 2}
# Half the images come from a pool (up to 640 px a side), half are small ones never seen before:
# the VisionEncoder's embedding cache (bounded by vision.encoder.cache_bytes) holds the pool
# after the warm-up, so its growth toward that bound is not read as a leak, and misses still come.
IMAGE_POOL = 32
LONG_PROMPT_TOKENS = 1500
MAX_TOKENS = 16
MAX_LOSSES = 20  # lost requests whose details the result keeps
TOOL_MAX_TOKENS = 64  # room for the whole call: a cut one is a 200 without tool_calls
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def png_url(rng: random.Random, width: int, height: int) -> str:
    colour = tuple(rng.randrange(256) for _ in range(3))
    return data_url(encode(Image.new("RGB", (width, height), colour), "PNG"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--duration-s", type=float, default=Options.duration_s,
                        help="seconds of load")
    parser.add_argument("--warmup-s", type=float, default=Options.warmup_s,
                        help="RSS growth is counted from the first sample after this")
    parser.add_argument("--concurrency", type=int, default=Options.concurrency,
                        help="closed-loop clients")
    parser.add_argument("--sample-s", type=float, default=Options.sample_s,
                        help="RSS and object store period")
    parser.add_argument("--settle-s", type=float, default=Options.settle_s,
                        help="how long the object store may take to return to its level")
    parser.add_argument("--timeout-s", type=float, default=Options.timeout_s,
                        help="a request with no complete answer after this long is lost")
    parser.add_argument("--seed", type=int, default=Options.seed)
    parser.add_argument("--port", type=int, default=8043)
    parser.add_argument("--out", default="bench-soak.json")


@dataclass
class Options:
    duration_s: float = 1200.0
    warmup_s: float = 120.0
    concurrency: int = 4
    sample_s: float = 10.0
    settle_s: float = 60.0
    timeout_s: float = 300.0
    seed: int = 0


@dataclass
class Tally:
    """What each kind of request came to: ok, cancelled, refused (429/503 with Retry-After),
    rejected (a 4xx, for bad requests), cut (a forced tool call that did not fit max_tokens: a 400
    naming it), or lost/<reason>."""

    by_kind: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    unexpected_5xx: int = 0
    losses: list[dict] = field(default_factory=list)  # the first MAX_LOSSES lost, with details

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.by_kind[kind][outcome] += 1
        if outcome.startswith("lost") and len(self.losses) < MAX_LOSSES:
            self.losses.append({"kind": kind, "outcome": outcome, "detail": detail[:500],
                                "at": time.strftime("%H:%M:%S")})

    def lost(self) -> int:
        return sum(n for c in self.by_kind.values() for o, n in c.items() if o.startswith("lost"))

    def sent(self) -> int:
        return sum(sum(c.values()) for c in self.by_kind.values())


class Mix:
    """Request bodies by kind, drawn with a seeded generator (the same run sends the same mix)."""

    def __init__(self, model: str, seed: int):
        self.model = model
        self.rng = random.Random(seed)
        self.deck: list[str] = []
        self.pool = [png_url(self.rng, self.rng.randrange(32, 640), self.rng.randrange(32, 640))
                     for _ in range(IMAGE_POOL)]
        self.bad = [raw for _, raw in bad_bodies(model)] + [
            self.encoded(self.chat([self.image_part(url), {"type": "text", "text": "?"}]))
            for name, url in broken_images().items() if name != "decompression bomb"]

    def kind(self) -> str:
        """The next card of a shuffled deck holding each kind as often as its weight, dealt so
        that its first len(KINDS) cards are one of each kind: every kind is sent early however
        slow the machine, and each deck of sum(KINDS.values()) requests has the mix exactly."""
        if not self.deck:
            rest = [kind for kind, weight in KINDS.items() for _ in range(weight - 1)]
            first = list(KINDS)
            self.rng.shuffle(first)
            self.rng.shuffle(rest)
            self.deck = rest + first  # dealt from the end
        return self.deck.pop()

    def chat(self, content, stream: bool = False, **fields) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": MAX_TOKENS, **fields}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    @staticmethod
    def image_part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    @staticmethod
    def encoded(body: dict) -> bytes:
        return json.dumps(body).encode()

    def body(self, kind: str) -> bytes:
        rng = self.rng
        question = f"Tell me about {filler_text(rng, 6)}."
        if kind == "chat":
            return self.encoded(self.chat(question))
        if kind in ("stream", "cancel"):
            return self.encoded(self.chat(question, stream=True))
        if kind == "image":
            url = rng.choice(self.pool) if rng.random() < 0.5 else \
                png_url(rng, rng.randrange(32, 64), rng.randrange(32, 64))
            return self.encoded(self.chat([self.image_part(url),
                                           {"type": "text", "text": "What is in the image?"}],
                                          stream=rng.random() < 0.5))
        if kind == "tool":
            return self.encoded(self.chat(f"What is the weather in {filler_text(rng, 2)}?",
                                          tools=[TOOL], tool_choice="required",
                                          max_tokens=TOOL_MAX_TOKENS))
        if kind == "long":
            return self.encoded(self.chat(filler_text(rng, LONG_PROMPT_TOKENS) + "\nSummarize.",
                                          max_tokens=4))
        return rng.choice(self.bad)


async def send(session: aiohttp.ClientSession, url: str, kind: str, raw: bytes,
               tally: Tally) -> None:
    body = json.loads(raw) if kind != "bad" else None
    try:
        async with session.post(url, data=raw, headers={"content-type": "application/json"}) as r:
            if r.status >= 500 and not (r.status == 503 and "Retry-After" in r.headers):
                tally.unexpected_5xx += 1
            if r.status in (429, 503) and "Retry-After" in r.headers:
                return tally.add(kind, "refused")
            if kind == "bad":
                rejected = 400 <= r.status < 500
                return tally.add(kind, "rejected" if rejected else f"lost/HTTP {r.status}",
                                 await r.text(errors="replace"))
            if r.status != 200:
                text = await r.text(errors="replace")
                code = error_code(text)
                if kind == "tool" and code == "tool_call_incomplete":
                    return tally.add(kind, "cut")  # a 400 naming max_tokens, as designed
                return tally.add(kind, f"lost/HTTP {r.status} {code}", text)
            if body.get("stream"):
                return tally.add(kind, *await read_stream(r, hang_up=kind == "cancel"))
            data = await r.json()
            message = data["choices"][0]["message"]
            if kind == "tool" and not message.get("tool_calls"):
                return tally.add(kind, "lost/no tool call", json.dumps(data))
            if data["usage"]["completion_tokens"] == 0:
                return tally.add(kind, "lost/no tokens", json.dumps(data))
            tally.add(kind, "ok")
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, KeyError) as exc:
        tally.add(kind, f"lost/{type(exc).__name__}", repr(exc))


def error_code(text: str) -> str | None:
    """The OpenAI error body's `code`, or None for a body that is not one (a proxy's own 5xx)."""
    try:
        return json.loads(text).get("error", {}).get("code")
    except (json.JSONDecodeError, AttributeError):
        return None


async def read_stream(response: aiohttp.ClientResponse, hang_up: bool) -> tuple[str, str]:
    """(outcome, detail): ok when the stream ends with usage and [DONE] and no error event;
    `hang_up` closes the connection at the first content token (cancelled)."""
    usage, last = False, b""
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        last = line
        if line.startswith(b"data: [DONE]"):
            return ("ok" if usage else "lost/no usage"), ""
        event = json.loads(line[6:])
        if "error" in event:
            return (f"lost/error event {event['error'].get('type')}",
                    line.decode(errors="replace"))
        usage = usage or bool(event.get("usage"))
        if hang_up and event["choices"] and event["choices"][0]["delta"].get("content"):
            response.close()
            return "cancelled", ""
    return "lost/cut stream", f"last event: {last.decode(errors='replace')}"


def process_rss_mb(server: ServerProcess) -> dict[str, float]:
    """RSS by process: 'title pid' (a Ray process's title up to its first space, e.g.
    ray::ServeReplica:moonserve:Router, else the executable's name)."""
    rss = {}
    for p in [psutil.Process(server.pid), *server.descendants()]:
        try:
            first = (p.cmdline() or [""])[0]
            # A Ray worker's title names its actor, then the task it runs now: keep the actor.
            title = first.split(" ")[0].split(".")[0] if first.startswith(("ray::", "VLLM")) \
                else p.name()
            rss[f"{title} {p.pid}"] = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return rss


def object_store_mb(metrics_url: str) -> float:
    """Bytes in Ray's object store (shared memory, disk fallback and spilled), from the node's
    `ray_object_store_memory` gauge at its Prometheus endpoint (what the dashboard's Object Store
    Memory panel shows; the raylet reports it every few seconds)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        text = r.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "ray_object_store_memory" for sample in family.samples
               if sample.labels.get("Location") in STORE_LOCATIONS) / 2**20


async def sample(server: ServerProcess, metrics_url: str, began: float) -> dict:
    rss, store = await asyncio.gather(asyncio.to_thread(process_rss_mb, server),
                                      asyncio.to_thread(object_store_mb, metrics_url))
    return {"t_s": round(time.monotonic() - began, 1), "object_store_mb": store, "rss_mb": rss}


async def load(url: str, mix: Mix, options: Options, tally: Tally, until: float) -> None:
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client():
            while time.monotonic() < until:
                kind = mix.kind()
                await send(session, url, kind, mix.body(kind), tally)

        await asyncio.gather(*(client() for _ in range(options.concurrency)))


async def soak(server: ServerProcess, metrics_url: str, model: str, options: Options) -> dict:
    """Runs the load against `server`, whose Ray node exports its metrics at `metrics_url`, and
    returns the result (see `judge` for the goals)."""
    url = f"{server.base_url}/v1/chat/completions"
    baseline = await asyncio.to_thread(object_store_mb, metrics_url)
    tally, samples = Tally(), []
    began = time.monotonic()
    traffic = asyncio.create_task(load(url, Mix(model, options.seed), options, tally,
                                       began + options.duration_s))
    while not traffic.done():
        samples.append(await sample(server, metrics_url, began))
        await asyncio.wait([traffic], timeout=options.sample_s)
    await traffic
    loaded = time.monotonic()
    await asyncio.sleep(STORE_REPORT_S)  # a report made after the load, not one from during it
    after = await asyncio.to_thread(object_store_mb, metrics_url)
    while after > baseline and time.monotonic() - loaded < options.settle_s:
        await asyncio.sleep(1)
        after = await asyncio.to_thread(object_store_mb, metrics_url)
    return judge(options, tally, samples, baseline, after, time.monotonic() - loaded)


def judge(options: Options, tally: Tally, samples: list[dict], baseline_mb: float,
          after_mb: float, settled_s: float) -> dict:
    warm = next((s for s in samples if s["t_s"] >= options.warmup_s), samples[-1])
    last = samples[-1]
    growth = {name: {"warm_mb": round(mb, 1), "last_mb": round(last["rss_mb"][name], 1),
                     "growth": round(last["rss_mb"][name] / mb - 1, 4)}
              for name, mb in warm["rss_mb"].items() if name in last["rss_mb"] and mb > 0}
    worst = max((g["growth"] for g in growth.values()), default=0.0)
    bad = tally.by_kind.get("bad", Counter())
    goals = {
        "rss_growth_at_most_10pct": worst <= MAX_RSS_GROWTH,
        "object_store_back_to_baseline": after_mb <= baseline_mb,
        "nothing_lost": tally.lost() == 0,
        "no_unexpected_5xx": tally.unexpected_5xx == 0,
        "bad_requests_4xx": set(bad) <= {"rejected"},
    }
    return {"benchmark": "soak", "duration_s": options.duration_s, "warmup_s": options.warmup_s,
            "concurrency": options.concurrency, "sent": tally.sent(), "lost": tally.lost(),
            "unexpected_5xx": tally.unexpected_5xx,
            "requests": {k: dict(c) for k, c in sorted(tally.by_kind.items())},
            "losses": tally.losses,
            "rss_warm_t_s": warm["t_s"], "rss_last_t_s": last["t_s"],
            "max_rss_growth": worst, "rss": growth,
            "object_store": {"baseline_mb": baseline_mb, "after_mb": after_mb,
                             "peak_mb": max(s["object_store_mb"] for s in samples),
                             "settled_s": round(settled_s, 1)},
            "goals": goals, "samples": samples}


def main(args: argparse.Namespace) -> int:
    model = load_app_config(args.config).language_model.engine.model_name()
    options = Options(**{f.name: getattr(args, f.name) for f in fields(Options)})
    metrics_port = args.port + 160
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", args.config,
           "--port", str(args.port), "--dashboard-port", str(args.port + 150),
           "--metrics-export-port", str(metrics_port)]
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp, \
            ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health",
                          Path(tmp) / "serve.log") as server:
        result = asyncio.run(soak(server, f"http://127.0.0.1:{metrics_port}/metrics", model,
                                  options))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"results written to {args.out}")
    return 0 if all(result["goals"].values()) else 1


def print_table(r: dict) -> None:
    store = r["object_store"]
    top = sorted(r["rss"].items(), key=lambda kv: -kv[1]["growth"])[:5]
    rows = [("requests sent", r["sent"]), ("lost", r["lost"]),
            ("unexpected 5xx", r["unexpected_5xx"]),
            *((f"  {kind}", ", ".join(f"{o} {n}" for o, n in sorted(c.items())))
              for kind, c in r["requests"].items()),
            (f"largest RSS growth, {r['rss_warm_t_s']:g} s -> {r['rss_last_t_s']:g} s",
             f"{100 * r['max_rss_growth']:.1f}%"),
            *((f"  {name}", f"{g['warm_mb']:.0f} -> {g['last_mb']:.0f} MB") for name, g in top),
            ("object store before / peak / after (MB)",
             f"{store['baseline_mb']:.1f} / {store['peak_mb']:.1f} / {store['after_mb']:.1f}"),
            *((f"goal: {name}", "met" if met else "NOT MET") for name, met in r["goals"].items())]
    for name, value in rows:
        print(f"{name:48} {value}")
