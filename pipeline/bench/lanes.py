"""Interactive TTFT while long-context requests saturate the LM: lanes on vs one FIFO lane.

One `moonserve serve` (one engine) runs the config's app with lanes on at `/`; the benchmark adds
a second Router with `router.lanes.enabled: false` at `/fifo`, bound to the same LanguageModel,
so both arms share the engine and differ only in admission. Each round measures, one after
another: interactive probes on the idle system; probes while `--background` long-context
streams run through the lanes app; the same through the FIFO app. Each arm's TTFT percentiles
are divided by the idle ones (all rounds pooled).

    moonserve bench lanes [--rounds 2] [--probes 20] [--background 8] [--out lanes.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from moonserve.pipeline.bench.client import percentile, stream_chat
from moonserve.pipeline.bench.corpus import filler_text
from moonserve.pipeline.config import DEFAULT_CONFIG, AppConfig, load_app_config
from moonserve.pipeline.app.launch import ServerProcess, join_ray

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="config with lanes on")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probes", type=int, default=20, help="interactive requests per arm")
    parser.add_argument("--probe-gap-s", type=float, default=0.2)
    parser.add_argument("--background", type=int, default=8,
                        help="concurrent long-context streams that saturate the LM")
    parser.add_argument("--long-prompt-tokens", type=int, default=None,
                        help="default: 3/4 of the context limit")
    parser.add_argument("--long-max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--out", default="bench-lanes.json")


def chat_body(model: str, content: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}


class Workload:
    def __init__(self, model: str, long_tokens: int, long_max_tokens: int):
        self.model = model
        self.long_tokens = long_tokens
        self.long_max_tokens = long_max_tokens
        self.rng = random.Random(0)

    def probe(self) -> dict:
        return chat_body(self.model, "Name three colors.", 8)

    def long(self) -> dict:
        text = "Summarize these words: " + filler_text(self.rng, self.long_tokens)
        return chat_body(self.model, text, self.long_max_tokens)


async def saturate(session, url: str, workload: Workload, stop: asyncio.Event, done: list[int]):
    """Keep one long-context stream running until `stop`; count the ones that finish."""
    while not stop.is_set():
        try:
            await stream_chat(session, url, workload.long())
            done.append(1)
        except RuntimeError:  # 429 from a full lane: back off like a client would
            await asyncio.sleep(0.2)


async def probes(session, url: str, workload: Workload, n: int, gap_s: float) -> list[float]:
    ttfts = []
    for _ in range(n):
        ttfts.append((await stream_chat(session, url, workload.probe())).ttft_s)
        await asyncio.sleep(gap_s)
    return ttfts


async def run_arm(base: str, args, workload: Workload, background: int) -> dict:
    url = f"{base}/v1/chat/completions"
    stop, done = asyncio.Event(), []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        workers = [asyncio.create_task(saturate(session, url, workload, stop, done))
                   for _ in range(background)]
        began = time.monotonic()
        if background:
            await asyncio.sleep(3.0)  # let the long prefills fill the engine
        ttfts = await probes(session, url, workload, args.probes, args.probe_gap_s)
        elapsed = time.monotonic() - began
        stop.set()
        for w in workers:
            w.cancel()  # client disconnects: the engine aborts these requests
        await asyncio.gather(*workers, return_exceptions=True)
    return {"ttft_ms": [1000 * t for t in ttfts], "long_completed": len(done),
            "long_per_min": 60 * len(done) / elapsed}


def wait_idle(lm_handle, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while lm_handle.stats.remote().result()["num_unfinished_requests"] and \
            time.monotonic() < deadline:
        time.sleep(0.2)


def deploy_fifo(config: AppConfig, model_path: str):
    from ray import serve

    from moonserve.deployments.builder import bind_router

    router = config.router.model_copy(
        update={"lanes": config.router.lanes.model_copy(update={"enabled": False})})
    lm_handle = serve.get_deployment_handle("LanguageModel", app_name="moonserve")
    serve.run(bind_router(router, lm_handle, model_path, chat=config.language_model.chat),
              name="fifo", route_prefix="/fifo")
    return lm_handle


def summarize_arm(rounds: list[dict], idle_p50: float, idle_p99: float) -> dict:
    ttft = [t for r in rounds for t in r["ttft_ms"]]
    p50, p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
    return {"probes": len(ttft), "ttft_ms_p50": p50, "ttft_ms_p99": p99,
            "p50_vs_idle": p50 / idle_p50, "p99_vs_idle": p99 / idle_p99,
            "long_completed": sum(r["long_completed"] for r in rounds),
            "long_per_min": sum(r["long_per_min"] for r in rounds) / len(rounds)}


def measure_rounds(base: str, args, workload: Workload, lm_handle) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {"idle": [], "lanes": [], "fifo": []}
    for _ in range(args.rounds):
        for arm, prefix, background in [("idle", "", 0), ("lanes", "", args.background),
                                        ("fifo", "/fifo", args.background)]:
            arms[arm].append(asyncio.run(run_arm(base + prefix, args, workload, background)))
            wait_idle(lm_handle)
    return arms


def main(args: argparse.Namespace) -> int:
    import ray

    from moonserve.deployments.builder import resolve_model_path

    config = load_app_config(args.config)
    model_path = resolve_model_path(config.language_model)
    max_len = config.language_model.engine.max_model_len or 4096
    long_tokens = args.long_prompt_tokens or (3 * max_len) // 4
    workload = Workload(config.language_model.engine.model_name(), long_tokens,
                        args.long_max_tokens)
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", args.config,
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp, \
            ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health",
                          Path(tmp) / "serve.log") as server:
        join_ray(server.ray_address())
        try:
            lm_handle = deploy_fifo(config, model_path)
            per_round = measure_rounds(server.base_url, args, workload, lm_handle)
        finally:
            ray.shutdown()
    result = report(args, config, long_tokens, per_round)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"results written to {args.out}")
    return 0


def report(args, config: AppConfig, long_tokens: int, per_round: dict) -> dict:
    idle = [t for r in per_round["idle"] for t in r["ttft_ms"]]
    idle_p50, idle_p99 = percentile(idle, 0.5), percentile(idle, 0.99)
    arms = {"idle": {"probes": len(idle), "ttft_ms_p50": idle_p50, "ttft_ms_p99": idle_p99}}
    arms |= {arm: summarize_arm(per_round[arm], idle_p50, idle_p99) for arm in ("lanes", "fifo")}
    return {"benchmark": "lanes", "config": args.config, "rounds": args.rounds,
            "background_streams": args.background, "long_prompt_tokens": long_tokens,
            "long_max_tokens": args.long_max_tokens,
            "lanes": config.router.lanes.model_dump(),
            "engine": config.language_model.engine.model_dump(include={
                "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                "scheduling_policy"}),
            "arms": arms, "per_round": per_round}


def print_table(result: dict) -> None:
    print(f"{'arm':6} {'probes':>6} {'TTFT p50 ms':>12} {'p99 ms':>9} {'p50/idle':>9} "
          f"{'p99/idle':>9} {'long/min':>9}")
    for arm, a in result["arms"].items():
        print(f"{arm:6} {a['probes']:>6} {a['ttft_ms_p50']:>12.1f} {a['ttft_ms_p99']:>9.1f} "
              f"{a.get('p50_vs_idle', 1.0):>9.2f} {a.get('p99_vs_idle', 1.0):>9.2f} "
              f"{a.get('long_per_min', 0.0):>9.1f}")
