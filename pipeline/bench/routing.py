"""Routing to two LanguageModel replicas: prefix-affinity vs Serve's default vs one replica.

Each arm starts `moonserve serve` on the config with its LanguageModel settings overridden (one
arm's engines alive at a time) and runs the same multi-turn workload: `--conversations` chats,
each a shared system prompt (one of `--system-prompts`) and 4-8 turns, some opening with an image
drawn from a pool of two (so some conversations share it), sent by `--users` concurrent users, a
turn after the previous answer. Arms:

- `prefix_affinity`: two replicas, `language_model.routing.policy: prefix_affinity`;
- `power_of_two`: two replicas, Serve's default router;
- `one_replica`: one replica, every prefix in one cache (the hit-rate ceiling).

Per arm: the prefix-cache hit rate from vLLM's own counters (`prefix_cache_hits /
prefix_cache_queries`, summed over the replicas), TTFT p50/p99 (all turns, and turns after the
first), output tokens/s, and requests per replica. Speculation is off and each engine's OpenMP
runs one unbound thread, so two engines share the machine the same way in both two-replica arms.

    moonserve bench routing [--conversations 16] [--users 8] [--out bench-routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from moonserve.pipeline.app.launch import ServerProcess, join_ray
from moonserve.pipeline.bench.client import percentile, stream_chat
from moonserve.pipeline.bench.corpus import data_url, filler_text
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args

ARMS = {
    "prefix_affinity": {"replicas": 2, "policy": "prefix_affinity"},
    "power_of_two": {"replicas": 2, "policy": "power_of_two"},
    "one_replica": {"replicas": 1, "policy": "prefix_affinity"},
}
FOLLOW_UPS = ("Tell me more.", "Why is that?", "Give an example.", "Summarize that in a line.",
              "What else should I know?", "Explain it to a child.", "Any caveats?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Ray Serve config file")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--users", type=int, default=8, help="conversations in progress at once")
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--image-fraction", type=float, default=0.25,
                        help="conversations whose first turn has an image")
    parser.add_argument("--max-tokens", type=int, default=32, help="per answer")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--port", type=int, default=8140)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-routing.json", help="JSON results file")


@dataclass
class Conversation:
    system: str
    turns: list[str]
    image: str | None  # a data URL sent with the first turn


def conversations(args) -> list[Conversation]:
    from moonserve.pipeline.bench.vision_preprocess import sample_image

    rng = random.Random(args.seed)
    systems = [f"You are assistant {i}. Background: {filler_text(rng, args.system_tokens)}"
               for i in range(args.system_prompts)]
    images = [data_url(sample_image(112, 112, "PNG", seed=7 + i)) for i in range(2)]
    chats = []
    for i in range(args.conversations):
        first = f"I am user {i}. {filler_text(rng, 24)}. What do you make of this?"
        turns = [first] + [rng.choice(FOLLOW_UPS) for _ in range(rng.randint(3, 7))]
        image = rng.choice(images) if rng.random() < args.image_fraction else None
        chats.append(Conversation(systems[i % len(systems)], turns, image))
    return chats


def user_message(text: str, image: str | None) -> dict:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                        {"type": "text", "text": text}]}


async def run_workload(url: str, model: str, chats: list[Conversation], users: int,
                       max_tokens: int) -> tuple[list[dict], float]:
    """Every conversation, `users` at a time; one record per turn."""
    queue: asyncio.Queue = asyncio.Queue()
    for chat in chats:
        queue.put_nowait(chat)
    records: list[dict] = []

    async def user(session):
        while not queue.empty():
            chat = queue.get_nowait()
            messages = [{"role": "system", "content": chat.system}]
            for turn, text in enumerate(chat.turns):
                messages.append(user_message(text, chat.image if turn == 0 else None))
                body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0}
                result = await stream_chat(session, url, body)
                messages.append({"role": "assistant", "content": result.text})
                records.append({"turn": turn, "ttft_s": result.ttft_s,
                                "tokens": result.completion_tokens})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(user(session) for _ in range(users)))
        return records, time.perf_counter() - began


def replica_stats(handle, replicas: int) -> dict[str, dict]:
    """The LanguageModel's counters by replica (`stats` lands on a replica Serve picks: asked
    until every replica has answered)."""
    found: dict[str, dict] = {}
    for _ in range(200):
        stats = handle.stats.remote().result()
        found[stats["replica"]] = stats
        if len(found) == replicas:
            return found
    raise RuntimeError(f"only {len(found)} of {replicas} LanguageModel replicas answered")


def delta(before: dict[str, dict], after: dict[str, dict], key: str) -> dict[str, int]:
    return {replica: after[replica][key] - before.get(replica, {}).get(key, 0)
            for replica in after}


def arm_overrides(arm: dict) -> dict:
    return {"language_model": {
        "deployment": {"num_replicas": arm["replicas"], "max_ongoing_requests": 64},
        "routing": {"policy": arm["policy"]},
        # One unbound OpenMP thread per engine: two engines do not bind the same core.
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}},
        "draft": {"mode": "off"}}


def run_arm(name: str, args, model: str, chats: list[Conversation], tmp: Path) -> dict:
    import ray
    from ray import serve

    arm = ARMS[name]
    config = write_with_args(args.config, arm_overrides(arm), tmp / f"{name}.yaml")
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config),
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    with ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health", tmp / f"{name}.log",
                       start_timeout_s=900) as server:
        join_ray(server.ray_address())
        try:
            handle = serve.get_deployment_handle("LanguageModel", app_name="moonserve")
            before = replica_stats(handle, arm["replicas"])
            records, wall = asyncio.run(run_workload(f"{server.base_url}/v1/chat/completions",
                                                     model, chats, args.users, args.max_tokens))
            after = replica_stats(handle, arm["replicas"])
        finally:
            ray.shutdown()
    return summarize(records, wall, before, after)


def summarize(records: list[dict], wall: float, before: dict, after: dict) -> dict:
    queries = sum(delta(before, after, "prefix_cache_queries").values())
    hits = sum(delta(before, after, "prefix_cache_hits").values())
    per_replica = delta(before, after, "num_requests")
    ttft = [r["ttft_s"] * 1000 for r in records]
    later = [r["ttft_s"] * 1000 for r in records if r["turn"] > 0]
    tokens = sum(r["tokens"] for r in records)
    loads = sorted(per_replica.values())
    return {
        "requests": len(records),
        "prefix_cache_hit_rate": hits / queries if queries else float("nan"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p99": percentile(ttft, 0.99),
        "later_turns_ttft_ms_p50": percentile(later, 0.5),
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "requests_per_replica": per_replica,
        "load_ratio": loads[-1] / loads[0] if loads and loads[0] else float("inf"),
    }


def main(args: argparse.Namespace) -> int:
    config = load_app_config(args.config)
    model = config.language_model.engine.model_name()
    chats = conversations(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-routing-") as tmp:
        for name in args.arms:
            # A fresh process per arm: Serve's handles in a driver outlive its ray.shutdown().
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                results[name] = pool.submit(run_arm, name, args, model, chats, Path(tmp)).result()
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    report = {"benchmark": "routing", "workload": {
        "conversations": args.conversations, "users": args.users,
        "system_prompts": args.system_prompts, "system_tokens": args.system_tokens,
        "image_fraction": args.image_fraction, "max_tokens": args.max_tokens,
        "turns": sum(len(c.turns) for c in chats)}, "arms": results, "goals": goals(results)}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["goals"], indent=2))
    print(f"results written to {args.out}")
    return 0


def goals(results: dict) -> dict:
    """The issue's goals, for the arms that ran."""
    out = {}
    affinity = results.get("prefix_affinity")
    if affinity and "one_replica" in results:
        out["hit_rate_vs_one_replica"] = (affinity["prefix_cache_hit_rate"]
                                          / results["one_replica"]["prefix_cache_hit_rate"])
    if affinity and "power_of_two" in results:
        out["ttft_p50_vs_power_of_two"] = (affinity["ttft_ms_p50"]
                                           / results["power_of_two"]["ttft_ms_p50"])
    if affinity:
        out["load_ratio"] = affinity["load_ratio"]
    return out
