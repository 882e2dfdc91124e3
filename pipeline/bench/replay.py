"""Replay of a Mooncake trace: vLLM's server against moonserve with one and two LM replicas.

The trace is one of Mooncake's FAST'25 traces (kvcache-ai/Mooncake, `FAST25-release/traces/`):
one JSON line per request with its arrival `timestamp` (ms), `input_length`, `output_length` and
the `hash_ids` of its 512-token prompt blocks (equal ids: equal blocks, so sessions that extend
earlier prompts share their prefix). Scaled to this machine, as the JSON records:

- sessions: a session is the requests whose first two blocks are equal (every prompt starts with
  the same block 0; in the conversation trace a request extends the previous one of its session
  86% of the time); the replay takes the first `--sessions` sessions with at least
  `--min-turns` requests, all their requests over the trace's hour;
- time: each request arrives at its trace time, from the first chosen one, x `--time-scale`;
- prompts: each 512-token block becomes `--block-tokens` token ids drawn from the model's
  vocabulary with the hash id as the seed, so equal hash ids are equal blocks and every shared
  prefix of the trace is a shared prefix here (the trace has no text);
- outputs: `output_length` x `--output-scale`, within 1..`--max-output-tokens`, generated to that
  length (`ignore_eos`).

Each request is a streamed `/v1/completions` with the prompt as token ids, sent at its time
whatever is in flight. Per arm: goodput (requests per second of replay that met both
`--ttft-ms` and `--tpot-ms`), TTFT and TPOT p50/p99, the prefix-cache hit rate (cached prompt
tokens over prompt tokens, from each answer's `usage.prompt_tokens_details`), failures. One
arm's engines are alive at a time. Arms: `vllm` (its server, the config's engine arguments),
`moonserve` (the config, speculation off), `moonserve_2` (two LanguageModel replicas,
prefix-affinity routing, one unbound OpenMP thread per engine).

    moonserve bench replay --trace conversation_trace.jsonl --out bench-replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.bench.client import percentile
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args

ARMS = ("vllm", "moonserve", "moonserve_2")
TRACE_BLOCK_TOKENS = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True,
                        help="a Mooncake FAST'25 trace (JSONL: timestamp, input_length, "
                             "output_length, hash_ids)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Ray Serve config file")
    parser.add_argument("--out", default="bench-replay.json", help="JSON results file")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--sessions", type=int, default=20,
                        help="replay the trace's first N sessions of --min-turns or more")
    parser.add_argument("--min-turns", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="arrival times are the trace's times this many times over")
    parser.add_argument("--block-tokens", type=int, default=16,
                        help="tokens per 512-token block of the trace")
    parser.add_argument("--output-scale", type=float, default=1 / 16,
                        help="output lengths are the trace's times this")
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--ttft-ms", type=float, default=3000.0, help="goodput's TTFT target")
    parser.add_argument("--tpot-ms", type=float, default=250.0,
                        help="goodput's target for the mean time per output token after the "
                             "first")
    parser.add_argument("--port", type=int, default=8700)


@dataclass(frozen=True)
class ReplayRequest:
    at_s: float  # when it is sent, from the replay's start
    prompt: list[int]
    max_tokens: int
    trace_input_length: int


def block(hash_id: int, tokens: int, vocab: tuple[int, int]) -> list[int]:
    """The token ids standing for one trace block: the same for the same hash id."""
    rng = random.Random(hash_id)
    return [rng.randrange(*vocab) for _ in range(tokens)]


def workload(trace: Path, args, vocab: tuple[int, int]) -> list[ReplayRequest]:
    """The requests of the trace's first `args.sessions` sessions of `args.min_turns` or more,
    scaled (module docstring), in arrival order."""
    sessions: dict[tuple, list[dict]] = {}
    with trace.open() as lines:
        for line in lines:
            row = json.loads(line)
            sessions.setdefault(tuple(row["hash_ids"][:2]), []).append(row)
    chosen = [rows for rows in sessions.values() if len(rows) >= args.min_turns][:args.sessions]
    rows = sorted((row for session in chosen for row in session), key=lambda r: r["timestamp"])
    start = rows[0]["timestamp"] if rows else 0
    out = []
    for row in rows:
        prompt = [t for h in row["hash_ids"] for t in block(h, args.block_tokens, vocab)]
        max_tokens = min(args.max_output_tokens,
                         max(1, round(row["output_length"] * args.output_scale)))
        out.append(ReplayRequest((row["timestamp"] - start) / 1000 * args.time_scale, prompt,
                                 max_tokens, row["input_length"]))
    return out


@dataclass
class Outcome:
    ok: bool = False
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")  # mean per output token after the first
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def send(session: aiohttp.ClientSession, url: str, model: str,
               request: ReplayRequest) -> Outcome:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    outcome = Outcome()
    began = time.perf_counter()
    first = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = str(event["error"])[:200]
                    return outcome
                if event.get("choices") and event["choices"][0].get("text") and first is None:
                    first = time.perf_counter()
                if usage := event.get("usage"):
                    outcome.prompt_tokens = usage["prompt_tokens"]
                    outcome.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    outcome.cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    end = time.perf_counter()
    first = first or end
    outcome.ok = True
    outcome.ttft_s = first - began
    if outcome.output_tokens > 1:
        outcome.tpot_s = (end - first) / (outcome.output_tokens - 1)
    else:
        outcome.tpot_s = 0.0
    return outcome


async def replay(url: str, model: str, requests: list[ReplayRequest]) -> tuple[list[Outcome],
                                                                                float]:
    """Every request sent at its time; (outcomes in trace order, seconds from the first send to
    the last answer)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        began = time.perf_counter()

        async def at_time(request: ReplayRequest) -> Outcome:
            await asyncio.sleep(max(0.0, request.at_s - (time.perf_counter() - began)))
            return await send(session, url, model, request)

        outcomes = await asyncio.gather(*(at_time(r) for r in requests))
        return list(outcomes), time.perf_counter() - began


def summarize(outcomes: list[Outcome], wall_s: float, ttft_ms: float, tpot_ms: float) -> dict:
    done = [o for o in outcomes if o.ok]
    good = [o for o in done if o.ttft_s * 1000 <= ttft_ms and o.tpot_s * 1000 <= tpot_ms]
    ttft = [o.ttft_s * 1000 for o in done]
    tpot = [o.tpot_s * 1000 for o in done]
    prompt = sum(o.prompt_tokens for o in done)
    return {
        "requests": len(outcomes), "completed": len(done), "met_targets": len(good),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "goodput_rps": len(good) / wall_s, "throughput_rps": len(done) / wall_s,
        "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_p50": percentile(tpot, 0.5), "tpot_ms_p99": percentile(tpot, 0.99),
        "prefix_cache_hit_rate": sum(o.cached_tokens for o in done) / prompt if prompt else 0.0,
        "output_tokens_per_s": sum(o.output_tokens for o in done) / wall_s,
        "wall_s": wall_s,
    }


def moonserve_overrides(replicas: int) -> dict:
    lm: dict = {"deployment": {"num_replicas": replicas, "max_ongoing_requests": 64}}
    if replicas > 1:
        # One unbound OpenMP thread per engine: two engines do not bind the same core.
        lm |= {"routing": {"policy": "prefix_affinity"},
               "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}
    return {"language_model": lm, "draft": {"mode": "off"}}


def server(arm: str, args, tmp: Path) -> ServerProcess:
    from moonserve.deployments.builder import resolve_model_path
    from moonserve.pipeline.bench.overhead import vllm_command

    config = load_app_config(args.config).language_model
    if arm == "vllm":
        cmd = vllm_command(config.engine, resolve_model_path(config), args.port)
        return ServerProcess(cmd + ["--enable-prompt-tokens-details"],
                             f"http://127.0.0.1:{args.port}/health", tmp / "vllm.log",
                             env=dict(config.env), start_timeout_s=900)
    path = write_with_args(args.config, moonserve_overrides(2 if arm == "moonserve_2" else 1),
                           tmp / f"{arm}.yaml")
    return ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(path),
         "--port", str(args.port), "--dashboard-port", str(args.port + 150)],
        f"http://127.0.0.1:{args.port}/health", tmp / f"{arm}.log", start_timeout_s=900)


def vocabulary(args) -> tuple[int, int]:
    """Ids of ordinary tokens: past the tokenizer's special and added ones."""
    from transformers import AutoTokenizer

    from moonserve.deployments.builder import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(load_app_config(args.config).language_model))
    first = max(tokenizer.all_special_ids + [len(tokenizer.get_added_vocab())]) + 1
    return first, tokenizer.vocab_size


def main(args: argparse.Namespace) -> int:
    model = load_app_config(args.config).language_model.engine.model_name()
    requests = workload(Path(args.trace), args, vocabulary(args))
    results, failed = {}, {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-replay-") as tmp:
        for arm in args.arms:
            try:
                with server(arm, args, Path(tmp)) as running:
                    outcomes, wall = asyncio.run(
                        replay(f"{running.base_url}/v1/completions", model, requests))
            except Exception as exc:  # noqa: BLE001 - the other arms still run; the JSON says why
                failed[arm] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                print(f"{arm}: {exc}", file=sys.stderr)
                continue
            results[arm] = summarize(outcomes, wall, args.ttft_ms, args.tpot_ms)
            print(f"{arm}: {json.dumps(results[arm])}", flush=True)
    report = {
        "benchmark": "replay", "trace": Path(args.trace).name, "config": args.config,
        "scaling": {"sessions": args.sessions, "min_turns": args.min_turns,
                    "requests": len(requests), "time_scale": args.time_scale,
                    "block_tokens_per_512": args.block_tokens,
                    "output_scale": args.output_scale,
                    "max_output_tokens": args.max_output_tokens,
                    "prompt_tokens_mean": sum(len(r.prompt) for r in requests) / len(requests),
                    "output_tokens_mean": sum(r.max_tokens for r in requests) / len(requests),
                    "replay_s": requests[-1].at_s},
        "targets": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
        "arms": results, "failed_arms": failed,
        "goodput_vs_vllm": {arm: r["goodput_rps"] / results["vllm"]["goodput_rps"]
                            for arm, r in results.items()
                            if arm != "vllm" and results.get("vllm", {}).get("goodput_rps")},
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["goodput_vs_vllm"], indent=2))
    print(f"results written to {args.out}")
    return 0
