"""Decode speed with and without speculative decoding, on the embedded model, all arms in one run.

Arms: `off` (no speculation); `vllm_ngram` (vLLM's in-engine prompt lookup, `draft.mode: inline`;
`--vllm-ngram-k K` adds `vllm_ngram_kK`, the same at k = K); `service_ngram` (the DraftService,
`draft.mode: service`, with `draft.adaptive` as configured), `service_ngram_fixed` (the same with
adaptive drafting off: k drafts every step), `service_suffix` (the DraftService's suffix
drafter; `--suffix-spec-factor F` adds `service_suffix_fF`, the same with
`draft.suffix.max_spec_factor` F), `service_suffix_noprefetch` (the same with prefetching off:
every draft made on the step's path), `service_dspark` and `service_none`
(the service path drafting nothing: the cost of the path by itself); one engine for the service
arms, switched with `DraftService.set_drafter`.
Every arm uses the same n-gram sizes and greedy requests, so all arms must produce identical text
(`outputs_match_off`); all but `vllm_ngram_kK` draft at most `num_speculative_tokens` (the
config's, or `--num-speculative-tokens`).

Workloads: `copy` (rewrite/extract tasks whose answers copy from the prompt) and `chat` (plain
questions), both `--max-tokens` long; `short_chat` (one-line questions, 32-token answers); and
`agentic` (`--requests` of BFCL's multi-turn conversations as tool loops, each session's
requests one after another, at most 256 tokens each: `moonserve.pipeline.bench.agentic`).
`chat` and `short_chat` repeat their 10 questions past 10 requests, and a suffix drafter drafts a
repeated answer from its cache of responses. Each workload runs at every `--concurrency`
(requests, or sessions, in flight), `--rounds` times; the arms of one engine take turns within a
round, and each cell starts with an empty prefix cache and a new drafter. Per arm, workload and
concurrency: decode tokens/s (completion tokens / wall time; the median over rounds,
`speedup_vs_off` from the medians), per-request latency and TTFT, and from the engine and the
service: acceptance rate (accepted / draft tokens), mean acceptance length (1 + accepted /
drafts: tokens per verify step, as vLLM logs it) and prefetch hit rate (the prefetched drafts
that answered the next step: how often the overlap held); and `cpu_s`, the CPU seconds the
server's processes used during the cell: vLLM's engine, the DraftService replica, the rest
(`cpu_part`), since on a machine with few cores the parts take turns on them.

After the arms, `hidden_state_steps` (`moonserve.pipeline.bench.hidden_steps`): draft steps that
carry the target's hidden states to the `dspark_context` drafter through a real step server, at
batch 1, 8 and 64: request bytes per step, round trip p50/p99, the service's step time, and the
bytes at K3's widths (`--hidden-state-steps 0` skips it).

    moonserve bench speculative [--requests 8] [--max-tokens 96] [--concurrency 1 4 16]
                                [--rounds 3] [--num-speculative-tokens K] [--vllm-ngram-k K ...]
                                [--suffix-spec-factor F ...] [--arms a,b] [--workloads a,b]
                                [--hidden-state-steps N] [--out bench-speculative.json]
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


from moonserve.pipeline.bench import agentic, hidden_steps
from moonserve.pipeline.bench.client import percentile, run_load
from moonserve.pipeline.bench.corpus import chat_prompts, copy_prompts, short_chat_prompts
from moonserve.pipeline.bench.overhead import (
    cpu_per_token,
    cpu_seconds_by_process,
    is_engine,
)
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config, write_with_args
from moonserve.pipeline.app.launch import ServerProcess, join_ray



@dataclass(frozen=True)
class Arm:
    engine: str  # arms with the same engine share one server
    draft: dict = field(default_factory=dict)  # the engine's `draft` section (over the config's)
    drafter: str | None = None  # service arms: `DraftService.set_drafter(drafter, adaptive)`
    adaptive: bool | None = None  # None: `draft.adaptive` as configured
    settings: dict | None = None  # the drafter's settings over the config's (`set_drafter`)
    prefetch: bool | None = None  # None: `draft.prefetch` as configured


SERVICE = {"mode": "service", "drafter": "ngram"}
ARMS = {
    "off": Arm("off", {"mode": "off"}),
    "vllm_ngram": Arm("vllm_ngram", {"mode": "inline", "drafter": "ngram"}),
    "service_ngram_fixed": Arm("service", SERVICE, "ngram", adaptive=False),
    "service_ngram": Arm("service", SERVICE, "ngram"),
    "service_suffix": Arm("service", SERVICE, "suffix"),
    "service_suffix_noprefetch": Arm("service", SERVICE, "suffix", prefetch=False),
    "service_dspark": Arm("service", SERVICE, "dspark"),
    # The service path with no drafts at all: what speculation costs a step by itself.
    "service_none": Arm("service", SERVICE, "none"),
}
SHORT_CHAT_MAX_TOKENS = 32
# An agent step's answer: a required tool call must fit (the server refuses a cut-off one).
AGENTIC_MAX_TOKENS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--requests", type=int, default=8, help="requests per workload and arm")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="requests (agentic: sessions) in flight; each value is a cell")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each cell runs; tokens/s is the median")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--workloads", default="copy,chat,short_chat",
                        help=f"subset of {','.join(WORKLOADS)}")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="the most drafts per step for every arm (default: the config's)")
    parser.add_argument("--vllm-ngram-k", type=int, nargs="*", default=[],
                        help="also run vLLM's ngram at these k (arms vllm_ngram_kK)")
    parser.add_argument("--suffix-spec-factor", type=float, nargs="*", default=[],
                        help="also run the DraftService's suffix drafter with these "
                             "draft.suffix.max_spec_factor (arms service_suffix_fF, on the "
                             "service arms' engine)")
    parser.add_argument("--hidden-state-steps", type=int, default=20,
                        help="decode steps per batch size (1, 8, 64) of the hidden-state draft "
                             "step measurement (bytes, round trip); 0 skips it")
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--out", default="bench-speculative.json")


@dataclass(frozen=True)
class Prompts:
    """One-turn chat requests, `concurrency` in flight."""

    prompts: list[str]
    max_tokens: int

    def run(self, url: str, model: str, concurrency: int) -> tuple[list, list[str], float]:
        """All requests: their results, texts (in prompt order) and wall seconds."""
        results, wall = asyncio.run(run_load(url, self.bodies(model), concurrency))
        return results, [r.text for r in results], wall

    def warm_up(self, url: str, model: str) -> None:
        asyncio.run(run_load(url, self.bodies(model)[:1], 1))

    def bodies(self, model: str) -> list[dict]:
        return [{"model": model, "messages": [{"role": "user", "content": p}],
                 "max_tokens": self.max_tokens, "temperature": 0} for p in self.prompts]


@dataclass(frozen=True)
class Sessions:
    """Agent sessions (tool loops), `concurrency` sessions in flight."""

    sessions: list[agentic.AgentSession]
    max_tokens: int

    def run(self, url: str, model: str, concurrency: int) -> tuple[list, list[str], float]:
        """All sessions' requests: their results, each session's transcript, wall seconds."""
        return asyncio.run(agentic.run_sessions(url, self.body(model), self.sessions,
                                                concurrency))

    def warm_up(self, url: str, model: str) -> None:
        first = agentic.AgentSession("warm-up", self.sessions[0].tools, self.sessions[0].turns[:1])
        asyncio.run(agentic.run_sessions(url, self.body(model), [first], 1, max_steps=1))

    def body(self, model: str) -> dict:
        return {"model": model, "max_tokens": self.max_tokens, "temperature": 0}


WORKLOADS = ("copy", "chat", "short_chat", "agentic")


def workloads(args) -> dict[str, Prompts | Sessions]:
    """The workloads asked for, by name."""
    wanted = args.workloads.split(",")
    unknown = set(wanted) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    n = args.requests
    every = {"copy": lambda: Prompts(copy_prompts(n), args.max_tokens),
             "chat": lambda: Prompts(chat_prompts(n), args.max_tokens),
             "short_chat": lambda: Prompts(short_chat_prompts(n), SHORT_CHAT_MAX_TOKENS),
             "agentic": lambda: Sessions(agentic.load_sessions(n), AGENTIC_MAX_TOKENS)}
    return {name: every[name]() for name in WORKLOADS if name in wanted}


def chosen_arms(args) -> dict[str, Arm]:
    """The arms asked for, each engine's draft section with `--num-speculative-tokens` applied."""
    k = {} if args.num_speculative_tokens is None else \
        {"num_speculative_tokens": args.num_speculative_tokens}
    arms = {name: dataclasses.replace(a, draft={**a.draft, **k}) for name, a in ARMS.items()}
    for extra in args.vllm_ngram_k:
        arms[f"vllm_ngram_k{extra}"] = Arm(f"vllm_ngram_k{extra}", {
            "mode": "inline", "drafter": "ngram", "num_speculative_tokens": extra})
    for factor in args.suffix_spec_factor:
        arms[f"service_suffix_f{factor:g}"] = Arm("service", {**SERVICE, **k}, "suffix",
                                                  settings={"max_spec_factor": factor})
    wanted = [a for a in args.arms.split(",") if a] + \
        [f"vllm_ngram_k{k}" for k in args.vllm_ngram_k] + \
        [f"service_suffix_f{f:g}" for f in args.suffix_spec_factor]
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
                "call_ms": {k: v for k, v in s.items() if k.startswith("call_ms")} or None,
                "min_acceptance": s["min_acceptance"]}
    return out


DRAFT_SERVICE_TITLE = "ray::ServeReplica:moonserve:DraftService"


def cpu_part(title: str) -> str:
    """Which part of the server a process is, by its title (`cpu_seconds_by_process`'s):
    `engine` (vLLM's engine core and its workers, the overhead bench's `is_engine`),
    `draft_service` (the DraftService replica), `rest` (Ray's daemons, Serve's proxy, the other
    replicas)."""
    if is_engine(title):
        return "engine"
    return "draft_service" if title.startswith(DRAFT_SERVICE_TITLE) else "rest"


def cpu_by_part(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by `cpu_part` between two readings of `cpu_seconds_by_process` (the overhead
    bench's: a process that ended in between is not counted, one that started counts in full)."""
    out = dict.fromkeys(("engine", "draft_service", "rest"), 0.0)
    for title, ms in cpu_per_token(before, after, 1).items():
        out[cpu_part(title)] += ms / 1000
    return {part: round(seconds, 2) for part, seconds in out.items()}


def measure(base_url: str, model: str, workload: Prompts | Sessions, concurrency: int,
            arm: Arm, lm, draft, server: ServerProcess) -> dict:
    """One round of one cell: the workload at `concurrency` on an engine whose prefix cache was
    emptied (arms sharing an engine would reuse each other's prefills), after one warm-up
    request, with the arm's drafter new (a suffix drafter would otherwise draft answers it saw
    in an earlier cell or in the warm-up)."""
    url = f"{base_url}/v1/chat/completions"
    if not lm.reset_prefix_cache.remote().result():
        raise RuntimeError("the engine kept its prefix cache: a request was still running")
    workload.warm_up(url, model)  # not counted
    if arm.drafter is not None:
        draft.set_drafter.remote(arm.drafter, arm.adaptive, settings=arm.settings,
                                 prefetch=arm.prefetch).result()
    before = counters(lm, draft)
    cpu_before = cpu_seconds_by_process(server)
    results, texts, wall = workload.run(url, model, concurrency)
    cpu_after = cpu_seconds_by_process(server)
    after = counters(lm, draft)
    call_ms = after.pop("call_ms", None)
    min_acceptance = after.pop("min_acceptance", None)
    before.pop("call_ms", None)
    before.pop("min_acceptance", None)
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
        # the acceptance threshold the engine's load set for the cell's last draft step
        "min_acceptance_last": min_acceptance,
        # CPU seconds the server's parts used during the cell (the machine's cores are shared)
        "cpu_s": cpu_by_part(cpu_before, cpu_after),
        "texts": texts,  # in prompt (agentic: session) order, compared across arms
    }


def median_cell(rounds: list[dict]) -> dict:
    """A cell's rounds as one: the round with the median tokens/s (the lower middle of an even
    count), its tokens/s across rounds, and every round."""
    ranked = sorted(rounds, key=lambda r: r["decode_tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "decode_tokens_per_s_rounds": [r["decode_tokens_per_s"] for r in rounds],
            "rounds": rounds}


def run_engine(engine: str, arms: dict[str, Arm], args, tmp: Path) -> dict[str, dict]:
    import ray

    config_file = arm_config(args.config, next(iter(arms.values())).draft, tmp / f"{engine}.yaml")
    model = load_app_config(config_file).language_model.engine.model_name()
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config_file),
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    loads = workloads(args)
    rounds: dict[tuple[str, str, int], list[dict]] = {}
    with ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health", tmp / f"{engine}.log",
                       start_timeout_s=600) as server:
        join_ray(server.ray_address())
        try:
            first = next(iter(arms.values()))
            lm, draft = handles(with_draft_service=first.drafter is not None)
            for _ in range(args.rounds):
                for name, arm in arms.items():
                    for workload, load in loads.items():
                        for c in args.concurrency:
                            rounds.setdefault((name, workload, c), []).append(
                                measure(server.base_url, model, load, c, arm, lm, draft,
                                        server))
        finally:
            ray.shutdown()
    results: dict[str, dict] = {}
    for (name, workload, c), cell in rounds.items():
        results.setdefault(name, {}).setdefault(workload, {})[f"c{c}"] = median_cell(cell)
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
        if args.rounds < 1 or min(args.concurrency) < 1:
            raise ValueError(f"--rounds ({args.rounds}) and --concurrency ({args.concurrency}) "
                             "must be at least 1")
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
    """Each cell's tokens/s against `off`'s in the same cell, and whether every round's texts
    equal `off`'s first round's."""
    base = results.get("off") or {}
    for by_workload in results.values():
        for workload, by_c in by_workload.items():
            for c, cell in by_c.items():
                if workload not in base:
                    continue
                off = base[workload][c]
                cell["speedup_vs_off"] = cell["decode_tokens_per_s"] / off["decode_tokens_per_s"]
                texts = off["rounds"][0]["texts"]
                cell["outputs_match_off"] = all(r["texts"] == texts for r in cell["rounds"])
    config = load_app_config(args.config).draft
    return {"benchmark": "speculative", "config": args.config, "requests": args.requests,
            "max_tokens": args.max_tokens, "short_chat_max_tokens": SHORT_CHAT_MAX_TOKENS,
            "agentic_max_tokens": AGENTIC_MAX_TOKENS,
            "concurrency": args.concurrency, "rounds": args.rounds,
            "num_speculative_tokens": args.num_speculative_tokens or config.num_speculative_tokens,
            "ngram": [config.ngram_min, config.ngram_max], "deadline_ms": config.deadline_ms,
            "prefetch": config.prefetch, "adaptive": dataclasses.asdict(config.adaptive),
            "suffix": dataclasses.asdict(config.suffix), "arms": results}


def print_table(report: dict) -> None:
    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    print(f"{'arm':15} {'workload':10} {'c':>3} {'tok/s':>7} {'vs off':>7} {'lat ms':>8} "
          f"{'accept':>7} {'len':>5} {'prefetch':>8} {'call ms':>7} {'same':>5}")
    for arm, by_workload in report["arms"].items():
        for name, by_c in by_workload.items():
            for c, r in by_c.items():
                print(f"{arm:15} {name:10} {c[1:]:>3} {r['decode_tokens_per_s']:>7.1f} "
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
