"""Decode speed with and without speculative decoding, on the embedded model, all arms in one run.

Arms: `off` (no speculation); `vllm_ngram` (vLLM's in-engine prompt lookup, `draft.mode: inline`;
`--vllm-ngram-k K` adds `vllm_ngram_kK`, the same at k = K); `service_ngram` (the DraftService,
`draft.mode: service`, with `draft.adaptive` as configured), `service_ngram_fixed` (the same with
adaptive drafting off: k drafts every step), `service_dspark` and `service_none` (the service
path drafting nothing: the cost of the path by itself); one engine for the service arms, switched
with `DraftService.set_drafter`. Every arm uses the same n-gram sizes and greedy
requests, so all arms must produce identical text (`outputs_match_off`); all but `vllm_ngram_kK`
draft at most `num_speculative_tokens` (the config's, or `--num-speculative-tokens`).

Workloads: `copy` (rewrite/extract tasks whose answers copy from the prompt), `chat` (plain
questions), both `--max-tokens` long, and `short_chat` (one-line questions, 32-token answers).
Requests run `--concurrency` at a time. Per arm and workload: decode tokens/s
(completion tokens / wall time), per-request latency and TTFT, and from the engine and the
service: acceptance rate (accepted / draft tokens), mean acceptance length (1 + accepted / drafts:
tokens per verify step, as vLLM logs it) and prefetch hit rate.

After the arms, `hidden_state_steps` (`moonserve.pipeline.bench.hidden_steps`): draft steps that
carry the target's hidden states to the `dspark_context` drafter through a real step server, at
batch 1, 8 and 64: request bytes per step, round trip p50/p99, the service's step time, and the
bytes at K3's widths (`--hidden-state-steps 0` skips it).

    moonserve bench speculative [--requests 8] [--max-tokens 96] [--num-speculative-tokens K]
                                [--vllm-ngram-k K ...] [--arms a,b] [--hidden-state-steps N]
                                [--out bench-speculative.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


from moonserve.pipeline.bench import hidden_steps
from moonserve.pipeline.bench.client import percentile, run_load
from moonserve.pipeline.bench.corpus import chat_prompts, copy_prompts, short_chat_prompts
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args
from moonserve.pipeline.app.launch import ServerProcess



@dataclass(frozen=True)
class Arm:
    engine: str  # arms with the same engine share one server
    draft: dict = field(default_factory=dict)  # the engine's `draft` section (over the config's)
    drafter: str | None = None  # service arms: `DraftService.set_drafter(drafter, adaptive)`
    adaptive: bool | None = None  # None: `draft.adaptive` as configured


SERVICE = {"mode": "service", "drafter": "ngram"}
ARMS = {
    "off": Arm("off", {"mode": "off"}),
    "vllm_ngram": Arm("vllm_ngram", {"mode": "inline", "drafter": "ngram"}),
    "service_ngram_fixed": Arm("service", SERVICE, "ngram", adaptive=False),
    "service_ngram": Arm("service", SERVICE, "ngram"),
    "service_dspark": Arm("service", SERVICE, "dspark"),
    # The service path with no drafts at all: what speculation costs a step by itself.
    "service_none": Arm("service", SERVICE, "none"),
}
SHORT_CHAT_MAX_TOKENS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--requests", type=int, default=8, help="requests per workload and arm")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--workloads", default="copy,chat,short_chat",
                        help="subset of copy,chat,short_chat")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="the most drafts per step for every arm (default: the config's)")
    parser.add_argument("--vllm-ngram-k", type=int, nargs="*", default=[],
                        help="also run vLLM's ngram at these k (arms vllm_ngram_kK)")
    parser.add_argument("--hidden-state-steps", type=int, default=20,
                        help="decode steps per batch size (1, 8, 64) of the hidden-state draft "
                             "step measurement (bytes, round trip); 0 skips it")
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--out", default="bench-speculative.json")


def workloads(args) -> dict[str, tuple[list[str], int]]:
    """name -> (prompts, max_tokens)."""
    n = args.requests
    every = {"copy": (copy_prompts(n), args.max_tokens), "chat": (chat_prompts(n), args.max_tokens),
             "short_chat": (short_chat_prompts(n), SHORT_CHAT_MAX_TOKENS)}
    wanted = args.workloads.split(",")
    unknown = set(wanted) - set(every)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {','.join(every)}")
    return {name: every[name] for name in wanted}


def chosen_arms(args) -> dict[str, Arm]:
    """The arms asked for, each engine's draft section with `--num-speculative-tokens` applied."""
    k = {} if args.num_speculative_tokens is None else \
        {"num_speculative_tokens": args.num_speculative_tokens}
    arms = {name: Arm(a.engine, {**a.draft, **k}, a.drafter, a.adaptive)
            for name, a in ARMS.items()}
    for extra in args.vllm_ngram_k:
        arms[f"vllm_ngram_k{extra}"] = Arm(f"vllm_ngram_k{extra}", {
            "mode": "inline", "drafter": "ngram", "num_speculative_tokens": extra})
    wanted = [a for a in args.arms.split(",") if a] + [f"vllm_ngram_k{k}" for k in
                                                       args.vllm_ngram_k]
    unknown = set(wanted) - set(arms)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {','.join(ARMS)}")
    return {name: arms[name] for name in arms if name in wanted}


def arm_config(config_path: str, draft: dict, out: Path) -> Path:
    """A copy of the config file with the app's `draft` section overridden."""
    return write_with_args(config_path, {"draft": draft}, out)


def handles(with_draft_service: bool):
    from ray import serve

    lm = serve.get_deployment_handle("LanguageModel", app_name="moonserve")
    draft = serve.get_deployment_handle("DraftService", app_name="moonserve") \
        if with_draft_service else None
    return lm, draft


def counters(lm, draft) -> dict:
    stats = lm.stats.remote().result()
    out = {k: stats[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if draft is not None:
        s = draft.stats.remote().result()
        out |= {"prefetch_hits": s["num_prefetch_hits"], "prefetch_misses": s["num_prefetch_misses"],
                "call_ms": {k: v for k, v in s.items() if k.startswith("call_ms")} or None}
    return out


def measure(base_url: str, model: str, prompts: list[str], max_tokens: int, args, lm,
            draft) -> dict:
    bodies = [{"model": model, "messages": [{"role": "user", "content": p}],
               "max_tokens": max_tokens, "temperature": 0} for p in prompts]
    url = f"{base_url}/v1/chat/completions"
    asyncio.run(run_load(url, bodies[:1], 1))  # warm-up, not counted
    before = counters(lm, draft)
    results, wall = asyncio.run(run_load(url, bodies, args.concurrency))
    after = counters(lm, draft)
    call_ms = after.pop("call_ms", None)
    before.pop("call_ms", None)
    delta = {k: after[k] - before[k] for k in after}
    tokens = sum(r.completion_tokens for r in results)
    latencies = [r.e2e_s * 1000 for r in results]
    drafts, drafted, accepted = (delta["num_drafts"], delta["num_draft_tokens"],
                                 delta["num_accepted_tokens"])
    prefetched = delta.get("prefetch_hits", 0) + delta.get("prefetch_misses", 0)
    return {
        "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
        "decode_tokens_per_s": tokens / wall,
        "latency_ms_mean": statistics.fmean(latencies),
        "latency_ms_p50": percentile(latencies, 0.5),
        "ttft_ms_p50": percentile([r.ttft_s * 1000 for r in results], 0.5),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "prefetch_hit_rate": delta["prefetch_hits"] / prefetched if prefetched else None,
        "spec_counters": delta,
        # round trips of draft calls as the engine step waited (the active drafter's recent ones)
        "draft_call_ms": call_ms,
        "texts": [r.text for r in results],  # in prompt order, compared across arms
    }


def run_engine(engine: str, arms: dict[str, Arm], args, tmp: Path) -> dict[str, dict]:
    import ray

    config_file = arm_config(args.config, next(iter(arms.values())).draft, tmp / f"{engine}.yaml")
    model = load_app_config(config_file).language_model.engine.model_name()
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config_file),
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    results = {}
    with ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health", tmp / f"{engine}.log",
                       start_timeout_s=600) as server:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        try:
            first = next(iter(arms.values()))
            lm, draft = handles(with_draft_service=first.drafter is not None)
            for name, arm in arms.items():
                if arm.drafter is not None:
                    draft.set_drafter.remote(arm.drafter, arm.adaptive).result()
                results[name] = {
                    workload: measure(server.base_url, model, prompts, max_tokens, args, lm, draft)
                    for workload, (prompts, max_tokens) in workloads(args).items()}
        finally:
            ray.shutdown()
    return results


def run_engine_in_child(engine: str, arms: dict[str, Arm], args, tmp: Path) -> dict[str, dict]:
    """`run_engine` in a fresh process: Serve's client state does not survive one Ray cluster
    being replaced by the next within a process."""
    import multiprocessing

    out = tmp / f"{engine}.json"
    child = multiprocessing.get_context("spawn").Process(
        target=_run_engine_to_file, args=(engine, arms, args, tmp, out))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the {engine} arm failed (exit {child.exitcode}); server log in "
                           f"{tmp / (engine + '.log')}")
    return json.loads(out.read_text())


def _run_engine_to_file(engine: str, arms: dict[str, Arm], args, tmp: Path, out: Path) -> None:
    out.write_text(json.dumps(run_engine(engine, arms, args, tmp)))


def main(args: argparse.Namespace) -> int:
    try:
        arms = chosen_arms(args)
        workloads(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    per_engine: dict[str, dict[str, Arm]] = {}
    for name, arm in arms.items():
        per_engine.setdefault(arm.engine, {})[name] = arm
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp:
        for engine, engine_arms in per_engine.items():
            results |= run_engine_in_child(engine, engine_arms, args, Path(tmp))
    report = summarize(args, results)
    if args.hidden_state_steps > 0:  # after the engines: nothing else is running
        report["hidden_state_steps"] = hidden_steps.measure(
            args.hidden_state_steps, report["num_speculative_tokens"])
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(report)
    print_hidden_steps(report.get("hidden_state_steps"))
    print(f"results written to {args.out}")
    return 0


def summarize(args, results: dict[str, dict]) -> dict:
    base = results.get("off")
    for by_workload in results.values():
        for name, r in by_workload.items():
            if base is not None:
                r["speedup_vs_off"] = r["decode_tokens_per_s"] / base[name]["decode_tokens_per_s"]
                r["outputs_match_off"] = r["texts"] == base[name]["texts"]
    config = load_app_config(args.config).draft
    return {"benchmark": "speculative", "config": args.config, "requests": args.requests,
            "max_tokens": args.max_tokens, "short_chat_max_tokens": SHORT_CHAT_MAX_TOKENS,
            "concurrency": args.concurrency,
            "num_speculative_tokens": args.num_speculative_tokens or config.num_speculative_tokens,
            "ngram": [config.ngram_min, config.ngram_max], "deadline_ms": config.deadline_ms,
            "prefetch": config.prefetch, "adaptive": dataclasses.asdict(config.adaptive),
            "arms": results}


def print_table(report: dict) -> None:
    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    print(f"{'arm':15} {'workload':8} {'tok/s':>7} {'vs off':>7} {'lat ms':>8} {'accept':>7} "
          f"{'len':>5} {'prefetch':>8} {'call ms':>7} {'same':>5}")
    for arm, by_workload in report["arms"].items():
        for name, r in by_workload.items():
            print(f"{arm:15} {name:8} {r['decode_tokens_per_s']:>7.1f} "
                  f"{fmt(r.get('speedup_vs_off')):>7} {r['latency_ms_mean']:>8.0f} "
                  f"{fmt(r['acceptance_rate']):>7} {fmt(r['mean_acceptance_length']):>5} "
                  f"{fmt(r['prefetch_hit_rate']):>8} "
                  f"{fmt((r['draft_call_ms'] or {}).get('call_ms_p50')):>7} "
                  f"{r.get('outputs_match_off', '-')!s:>5}")


def print_hidden_steps(section: dict | None) -> None:
    if not section:
        return
    print(f"draft steps with hidden states (k={section['k']}, {section['new_tokens_per_row']} "
          f"new tokens per row, {section['hidden_dtype']}):")
    print(f"{'batch':>5} {'bytes/step':>11} {'bytes/row':>9} {'rtt p50 ms':>10} "
          f"{'rtt p99 ms':>10} {'service ms':>10} {'K3 bytes/step':>13} {'1 pass/request':>14}")
    for b, one in zip(section["batches"], section["per_request_passes"], strict=True):
        print(f"{b['batch']:>5} {b['bytes_per_step']:>11.0f} {b['bytes_per_row']:>9.0f} "
              f"{b['round_trip_ms_p50']:>10.1f} {b['round_trip_ms_p99']:>10.1f} "
              f"{b['service_step_ms_p50']:>10.1f} {b['bytes_per_step_k3']:>13} "
              f"{one['round_trip_ms_p50']:>14.1f}")
