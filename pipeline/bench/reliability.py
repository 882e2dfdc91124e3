"""Overload and fault figures: nothing lost, no 5xx, bounded memory, recovery time.

Against one `moonserve serve`:
0. bad inputs: the broken/odd image corpus and malformed bodies (pipeline/bench/corpus.py);
   every answer must be a 4xx or a 200, never a 5xx (the test suite also fuzzes ~2,300 bodies
   with hypothesis, tests/server/test_fuzz.py);
1. capacity: closed-loop chat requests at `--concurrency` for `--capacity-s` -> requests/s;
2. overload: open-loop arrivals at `--factor` x that rate for `--burst-s`; every request must
   complete (200, all tokens) or be refused fast (429/503 with Retry-After); anything else, or
   no answer within `--timeout-s`, counts as lost;
3. after the burst: TTFT and replica memory (RSS) before/after; replicas that crashed (a replica
   process that went away before the deliberate kill);
4. recovery: the LanguageModel replica process is SIGKILLed; seconds until a request succeeds.

    moonserve bench reliability [--factor 5] [--burst-s 30] [--out bench-reliability.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

from moonserve.pipeline.bench.client import percentile, stream_chat
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config
from moonserve.pipeline.app.launch import ServerProcess

MAX_TOKENS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--factor", type=float, default=5.0, help="offered load / capacity")
    parser.add_argument("--burst-s", type=float, default=30.0)
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8, help="capacity probe clients")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="a request with no complete answer after this long is lost")
    parser.add_argument("--port", type=int, default=8033)
    parser.add_argument("--out", default="bench-reliability.json")


def chat_body(model: str, i: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"Tell me fact {i}."}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


@dataclass
class Outcomes:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 429/503 with Retry-After
    lost: int = 0      # anything else: 5xx, error event, short stream, no answer in time
    reject_s: list[float] = field(default_factory=list)
    lost_reasons: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("reject_s", "lost_reasons")}
        out["reject_ms_p99"] = 1000 * percentile(self.reject_s, 0.99)
        out["lost_reasons"] = dict(self.lost_reasons)
        return out


async def one(session, url: str, body: dict, timeout_s: float, outcomes: Outcomes) -> None:
    outcomes.sent += 1
    began = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as r:
                if r.status in (429, 503) and "Retry-After" in r.headers:
                    outcomes.rejected += 1
                    outcomes.reject_s.append(time.monotonic() - began)
                    return
                data = await r.json()
        tokens = data.get("usage", {}).get("completion_tokens") if r.status == 200 else None
        if tokens == body["max_tokens"]:
            outcomes.completed += 1
        else:
            outcomes.lost += 1
            outcomes.lost_reasons[f"HTTP {r.status}" if r.status != 200 else "short"] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        outcomes.lost += 1
        outcomes.lost_reasons[type(exc).__name__] += 1


async def capacity(url: str, model: str, concurrency: int, seconds: float) -> float:
    """Completed requests per second with `concurrency` closed-loop clients."""
    done, stop = [0], time.monotonic() + seconds

    async def client(session, k):
        i = 0
        while time.monotonic() < stop:
            async with session.post(url, json=chat_body(model, k * 1000 + i)) as r:
                await r.read()
                done[0] += r.status == 200
            i += 1

    began = time.monotonic()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
    return done[0] / (time.monotonic() - began)


async def overload(url: str, model: str, rate: float, seconds: float, timeout_s: float) -> Outcomes:
    """Open-loop arrivals, evenly spaced, at `rate`/s for `seconds`; waits for every answer."""
    outcomes, tasks = Outcomes(), []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        began = time.monotonic()
        i = 0
        while (now := time.monotonic()) - began < seconds:
            tasks.append(asyncio.create_task(one(session, url, chat_body(model, i), timeout_s,
                                                 outcomes)))
            i += 1
            await asyncio.sleep(max(0.0, began + i / rate - now))
        await asyncio.gather(*tasks)
    return outcomes


async def ttft_ms(url: str, model: str, n: int = 5) -> float:
    async with aiohttp.ClientSession() as session:
        values = [(await stream_chat(session, url, chat_body(model, i))).ttft_s for i in range(n)]
    return 1000 * percentile(values, 0.5)


def replica_rss_mb(server: ServerProcess) -> dict[str, float]:
    rss: dict[str, float] = {}
    for p in server.descendants():
        try:
            title = (p.cmdline() or [""])[0]
            if title.startswith("ray::ServeReplica:") or title.startswith("VLLM"):
                key = title.split(" ")[0]
                rss[key] = rss.get(key, 0.0) + p.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return rss


def recovery_s(server: ServerProcess, url: str, model: str, timeout_s: float = 300) -> float:
    import httpx

    lm = next(p for p in server.descendants()
              if (p.cmdline() or [""])[0].startswith("ray::ServeReplica:moonserve:LanguageModel"))
    os.kill(lm.pid, signal.SIGKILL)
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            if httpx.post(url, json=chat_body(model, 0), timeout=10).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return float("inf")


def bad_inputs(url: str, model: str) -> dict:
    """Send the corpus; count what was tried and any 5xx."""
    import httpx

    from moonserve.pipeline.bench.corpus import bad_bodies, broken_images, odd_images

    statuses: Counter = Counter()
    images = {**broken_images(), **odd_images()}
    bodies = [json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "?"}]}]}).encode()
        for u in images.values()] + [raw for _, raw in bad_bodies(model)]
    for raw in bodies:
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=120)
        statuses[r.status_code] += 1
    return {"tried": len(bodies), "statuses": dict(statuses),
            "5xx": sum(n for s, n in statuses.items() if s >= 500)}


def replica_pids(server: ServerProcess) -> set[int]:
    pids = set()
    for p in server.descendants():
        try:
            if (p.cmdline() or [""])[0].startswith("ray::ServeReplica:"):
                pids.add(p.pid)
        except psutil.Error:
            continue
    return pids


def measure(server: ServerProcess, args, model: str) -> dict:
    url = f"{server.base_url}/v1/chat/completions"
    before_ttft = asyncio.run(ttft_ms(url, model))
    rss_before = replica_rss_mb(server)
    replicas = replica_pids(server)
    inputs = bad_inputs(url, model)
    rate = asyncio.run(capacity(url, model, args.concurrency, args.capacity_s))
    outcomes = asyncio.run(overload(url, model, args.factor * rate, args.burst_s, args.timeout_s))
    after_ttft = asyncio.run(ttft_ms(url, model))
    rss_after = replica_rss_mb(server)
    crashed = len(replicas - replica_pids(server))
    return {"bad_inputs": inputs, "replicas_crashed": crashed, "capacity_rps": rate, "offered_rps": args.factor * rate, "burst_s": args.burst_s,
            "overload": outcomes.summary(), "ttft_ms_before": before_ttft,
            "ttft_ms_after": after_ttft, "rss_mb_before": rss_before, "rss_mb_after": rss_after,
            "lm_recovery_s": recovery_s(server, url, model)}


def main(args: argparse.Namespace) -> int:
    model = load_app_config(args.config).language_model.engine.model_name()
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", args.config,
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp, \
            ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health",
                          Path(tmp) / "serve.log") as server:
        result = {"benchmark": "reliability", "factor": args.factor,
                  **measure(server, args, model)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"results written to {args.out}")
    o = result["overload"]
    clean = result["bad_inputs"]["5xx"] == 0 and result["replicas_crashed"] == 0
    return 0 if clean and o["lost"] == 0 and o["completed"] + o["rejected"] == o["sent"] else 1


def print_table(r: dict) -> None:
    o, bad = r["overload"], r["bad_inputs"]
    growth = max(r["rss_mb_after"].get(k, 0.0) - v for k, v in r["rss_mb_before"].items())
    rows = [("bad inputs tried", bad["tried"]), ("5xx seen", bad["5xx"]),
            ("replicas crashed", r["replicas_crashed"]),
            ("capacity (req/s)", f"{r['capacity_rps']:.2f}"),
            (f"offered for {r['burst_s']:g} s (req/s)", f"{r['offered_rps']:.2f}"),
            ("sent", o["sent"]), ("completed", o["completed"]), ("rejected 429/503", o["rejected"]),
            ("lost", o["lost"]), ("rejection p99 (ms)", f"{o['reject_ms_p99']:.1f}"),
            ("TTFT p50 before / after (ms)", f"{r['ttft_ms_before']:.0f} / {r['ttft_ms_after']:.0f}"),
            ("largest replica RSS growth (MB)", f"{growth:.1f}"),
            ("LM replica killed: serving again after (s)", f"{r['lm_recovery_s']:.1f}")]
    for name, value in rows:
        print(f"{name:44} {value}")
