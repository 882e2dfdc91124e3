"""Tool calling on BFCL: AST accuracy and argument validity, moonserve vs vLLM's own server.

Every arm serves the config's checkpoint and gets the same BFCL v4 entries (the first --limit of
each category), sent as BFCL sends them to an OpenAI function-calling model (the question's
messages as is, the functions converted by BFCL's own `convert_to_tool`; see bfcl.py), through
the `openai` client, greedy, once with tool_choice "auto" and once with "required". Arms:

  moonserve        `moonserve serve --config FILE`
  vllm-default     vLLM's OpenAI server: --enable-auto-tool-choice --tool-call-parser hermes
                   --chat-template smollm2_tools.jinja (argument schemas not enforced)
  vllm-parameter   the same with --tool-strict-level parameter (every tool as if `strict`)

Only one server is alive at a time. Per arm, category and tool_choice: requests, answered
(HTTP 200), errors, calls, the fraction of calls whose arguments parse as JSON and validate
against the tool's JSON Schema, BFCL's AST accuracy (ported checker; a failed request counts as
wrong), for `irrelevance` the fraction answered without a call, and seconds per request (wall /
requests, and mean latency). `irrelevance` is run with "auto" only: "required" forces a call,
so the no-call score would be 0 by construction. The comparison is moonserve minus the best
vLLM arm (accuracy, validity) and moonserve's seconds per request over the fastest vLLM arm's.
The default --limit 5 (3 arms x 9 cells x 5 requests) is sized for ~15 minutes on 2 CPU cores
with the embedded model: 2-8 s per request there (auto answers often run to --max-tokens).

    moonserve bench tools --out bench-tools.json
    moonserve bench tools --arms vllm-default vllm-parameter --limit 3 --categories simple_python irrelevance
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.bench import bfcl
from moonserve.pipeline.config import DEFAULT_CONFIG, LanguageModelConfig, load_app_config
from moonserve.pipeline.models.chat_templates import chat_template_path

ARMS = ("moonserve", "vllm-default", "vllm-parameter")
TOOL_CHOICES = ("auto", "required")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Ray Serve config file")
    parser.add_argument("--out", default="bench-tools.json", help="JSON results file")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                        help="arms to run (the comparison needs moonserve and a vLLM arm)")
    parser.add_argument("--categories", nargs="+", choices=bfcl.CATEGORIES,
                        default=list(bfcl.CATEGORIES), help="BFCL v4 categories")
    parser.add_argument("--tool-choice", nargs="+", choices=TOOL_CHOICES, default=list(TOOL_CHOICES),
                        help="tool_choice values to run (irrelevance: auto only)")
    parser.add_argument("--limit", type=int, default=5, help="first N entries of each category")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--port", type=int, default=8200,
                        help="vLLM arms' port; moonserve takes PORT+1, its dashboard PORT+2")


def vllm_tools_command(config: LanguageModelConfig, model_path: str, port: int,
                       strict_level: str | None) -> list[str]:
    """overhead.vllm_command plus vLLM's tool calling with the config's tool parser and chat
    template (the embedded model: `hermes` and pipeline/models/templates/smollm2_tools.jinja)."""
    from moonserve.pipeline.bench.overhead import vllm_command

    chat = config.chat
    if chat.tools.parser is None:
        raise ValueError("language_model.chat.tools.parser is not set in this config: no tools")
    cmd = vllm_command(config.engine, model_path, port) + [
        "--enable-auto-tool-choice", "--tool-call-parser", chat.tools.parser]
    if chat.template:
        cmd += ["--chat-template", str(chat_template_path(chat.template))]
    return cmd + (["--tool-strict-level", strict_level] if strict_level else [])


def servers(config: LanguageModelConfig, model_path: str, args, logs: Path):
    """(arm, ServerProcess) for each arm, in --arms order; the caller starts and stops each."""
    for arm in args.arms:
        if arm == "moonserve":
            yield arm, ServerProcess(
                [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config",
                 args.config, "--port", str(args.port + 1), "--dashboard-port", str(args.port + 2)],
                f"http://127.0.0.1:{args.port + 1}/health", logs / "moonserve.log")
        else:
            strict = "parameter" if arm == "vllm-parameter" else None
            yield arm, ServerProcess(vllm_tools_command(config, model_path, args.port, strict),
                                     f"http://127.0.0.1:{args.port}/health", logs / f"{arm}.log",
                                     env=dict(config.env))


@dataclass
class Answer:
    entry_id: str
    latency_s: float
    tool_calls: list[tuple[str, str]] | None  # (name, arguments JSON); None: the request failed
    content: str | None = None
    error: str | None = None
    finish_reason: str | None = None  # "length": cut at --max-tokens
    completion_tokens: int = 0


async def ask(client, model: str, entry: bfcl.Entry, tool_choice: str, max_tokens: int) -> Answer:
    import openai

    began = time.perf_counter()
    try:
        response = await client.chat.completions.create(
            model=model, messages=entry.messages, tools=entry.tools, tool_choice=tool_choice,
            temperature=0, max_tokens=max_tokens)
    except openai.APIError as exc:
        return Answer(entry.id, time.perf_counter() - began, None, error=f"{type(exc).__name__}: {exc}")
    choice = response.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    tokens = response.usage.completion_tokens if response.usage else 0
    return Answer(entry.id, time.perf_counter() - began, calls, choice.message.content,
                  finish_reason=choice.finish_reason, completion_tokens=tokens)


async def run_cell(client, model: str, entries: list[bfcl.Entry], tool_choice: str,
                   args) -> tuple[list[Answer], float]:
    """Every entry once, at most --concurrency in flight; answers in entry order, wall seconds."""
    gate = asyncio.Semaphore(args.concurrency)

    async def one(entry):
        async with gate:
            return await ask(client, model, entry, tool_choice, args.max_tokens)

    began = time.perf_counter()
    answers = await asyncio.gather(*(one(e) for e in entries))
    return list(answers), time.perf_counter() - began


def arguments_valid(entry: bfcl.Entry, name: str, arguments: str) -> bool:
    """The call names one of the entry's tools and its arguments are a JSON object that
    validates against that tool's parameters schema (Draft 2020-12)."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in entry.tools}
    if name not in schemas:
        return False
    try:
        instance = json.loads(arguments)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schemas[name]).is_valid(instance)


def cell_metrics(entries: list[bfcl.Entry], answers: list[Answer], wall_s: float) -> dict:
    """The figures of one arm x category x tool_choice; per-entry detail under `entries`."""
    rows = [entry_row(e, a) for e, a in zip(entries, answers)]
    n = len(rows)
    answered = [a for a in answers if a.tool_calls is not None]
    calls = sum(len(r["calls"]) for r in rows)
    valid_calls = sum(c["schema_valid"] for r in rows for c in r["calls"])
    no_call = sum(1 for a in answered if not a.tool_calls) / n
    ast = sum(r["valid"] for r in rows) / n
    irrelevance = entries[0].category == "irrelevance"
    return {
        "requests": n, "answered": len(answered), "errors": n - len(answered),
        "first_error": next((a.error for a in answers if a.error), None),
        "calls": calls, "requests_with_call": sum(1 for a in answered if a.tool_calls),
        "cut_at_max_tokens": sum(1 for a in answered if a.finish_reason == "length"),
        "completion_tokens": sum(a.completion_tokens for a in answered),
        "schema_valid_calls": valid_calls,
        "schema_valid_fraction": valid_calls / calls if calls else None,
        "ast_accuracy": None if irrelevance else ast,
        "no_call_fraction": no_call,
        # BFCL's score of the category: AST accuracy, or for irrelevance no call.
        "accuracy": ast, "accuracy_kind": "no_call" if irrelevance else "ast",
        "error_types": dict(Counter(r["error_type"] for r in rows if not r["valid"])),
        "wall_s": wall_s, "seconds_per_request": wall_s / n,
        "mean_latency_s": statistics.fmean(a.latency_s for a in answers),
        "entries": rows,
    }


def entry_row(entry: bfcl.Entry, answer: Answer) -> dict:
    verdict = bfcl.score_entry(entry, answer.tool_calls)
    return {"id": entry.id, "latency_s": answer.latency_s, "valid": verdict["valid"],
            "error_type": verdict["error_type"], "error": answer.error,
            "finish_reason": answer.finish_reason, "completion_tokens": answer.completion_tokens,
            "content": (answer.content or "")[:200],
            "calls": [{"name": name, "arguments": arguments,
                       "schema_valid": arguments_valid(entry, name, arguments)}
                      for name, arguments in answer.tool_calls or []]}


def cells(args) -> list[tuple[str, str]]:
    """(category, tool_choice) pairs to run: irrelevance only with auto."""
    return [(category, mode) for mode in args.tool_choice for category in args.categories
            if not (category == "irrelevance" and mode == "required")]


async def measure_arm(base_url: str, model: str, entries: dict[str, list[bfcl.Entry]],
                      args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                timeout=600)
    first = entries[args.categories[0]][0]
    await ask(client, model, first, "auto", 8)  # warm-up, not counted
    out: dict[str, dict] = {}
    for category, mode in cells(args):
        answers, wall = await run_cell(client, model, entries[category], mode, args)
        out.setdefault(category, {})[mode] = cell_metrics(entries[category], answers, wall)
    await client.close()
    return out


def comparison(arms: dict) -> dict:
    """Per category and tool_choice: moonserve minus the best vLLM arm (accuracy, schema
    validity), moonserve's seconds per request over the fastest vLLM arm's."""
    if "moonserve" not in arms:
        return {}
    out: dict[str, dict] = {}
    for category, modes in arms["moonserve"].items():
        for mode, ours in modes.items():
            theirs = {arm: cats[category][mode] for arm, cats in arms.items()
                      if arm != "moonserve" and mode in cats.get(category, {})}
            if theirs:
                out.setdefault(category, {})[mode] = compare_cell(ours, theirs)
    return out


def compare_cell(ours: dict, theirs: dict[str, dict]) -> dict:
    best = max(theirs, key=lambda arm: theirs[arm]["accuracy"])
    fastest = min(theirs, key=lambda arm: theirs[arm]["seconds_per_request"])
    validity = {arm: m["schema_valid_fraction"] for arm, m in theirs.items()
                if m["schema_valid_fraction"] is not None}
    best_valid = max(validity, key=validity.get) if validity else None
    delta_valid = (ours["schema_valid_fraction"] - validity[best_valid]
                   if best_valid and ours["schema_valid_fraction"] is not None else None)
    ratio = ours["seconds_per_request"] / theirs[fastest]["seconds_per_request"]
    return {"accuracy_delta": ours["accuracy"] - theirs[best]["accuracy"], "best_accuracy_arm": best,
            "schema_valid_delta": delta_valid, "best_validity_arm": best_valid,
            "seconds_per_request_ratio": ratio, "fastest_arm": fastest}


def percent(x: float | None) -> str:
    return "    -" if x is None else f"{100 * x:4.0f}%"


def print_table(arms: dict, rel: dict) -> None:
    print(f"{'arm':<15}{'category':<18}{'choice':<9}{'n':>3}{'ok':>4}{'cut':>4}{'calls':>6}"
          f"{'valid':>7}{'acc':>7}{'s/req':>7}{'lat':>7}")
    for arm, categories in arms.items():
        for category, modes in categories.items():
            for mode, m in modes.items():
                print(f"{arm:<15}{category:<18}{mode:<9}{m['requests']:>3}{m['answered']:>4}"
                      f"{m['cut_at_max_tokens']:>4}{m['calls']:>6}{percent(m['schema_valid_fraction']):>7}"
                      f"{percent(m['accuracy']):>7}{m['seconds_per_request']:>7.2f}"
                      f"{m['mean_latency_s']:>7.2f}")
                if m["first_error"]:
                    print(f"  {m['errors']} errors, first: {m['first_error'][:160]}")
    print("ok: HTTP 200; cut: stopped at --max-tokens; valid: calls whose arguments validate "
          "against the tool's schema; acc: BFCL AST accuracy (irrelevance: no call)")
    for category, modes in rel.items():
        for mode, r in modes.items():
            valid = "-" if r["schema_valid_delta"] is None else f"{100 * r['schema_valid_delta']:+.0f} pt"
            print(f"moonserve vs vLLM {category}/{mode}: accuracy {100 * r['accuracy_delta']:+.0f} pt "
                  f"(vs {r['best_accuracy_arm']}), validity {valid}, s/req x"
                  f"{r['seconds_per_request_ratio']:.2f} (vs {r['fastest_arm']})")


def summary(args, model: str, startup_s: dict[str, float], arms: dict) -> dict:
    """The JSON results: settings, {arm: {category: {tool_choice: metrics}}}, comparison."""
    return {"benchmark": "tools", "config": args.config, "model": model, "limit": args.limit,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "categories": args.categories, "tool_choice": args.tool_choice,
            "startup_s": startup_s, "arms": arms, "comparison": comparison(arms)}


def main(args: argparse.Namespace) -> int:
    from moonserve.deployments.builder import resolve_model_path

    config = load_app_config(args.config).language_model
    model_path = resolve_model_path(config)
    entries = {c: bfcl.load_entries(c, args.limit) for c in args.categories}
    arms: dict[str, dict] = {}
    startup_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp:
        for arm, server in servers(config, model_path, args, Path(tmp)):
            with server:
                startup_s[arm] = server.startup_s
                arms[arm] = asyncio.run(measure_arm(server.base_url, config.engine.model_name(),
                                                    entries, args))
    result = summary(args, config.engine.model_name(), startup_s, arms)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(arms, result["comparison"])
    print(f"results written to {args.out}")
    return 0
