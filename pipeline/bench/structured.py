"""Structured outputs on public JSON Schemas: valid / refused / cut / unenforced, vs vLLM's server.

Each schema is sent once as a strict `response_format: json_schema` (the schema also in the
prompt, so the model has a chance), greedy, `--max-tokens` 128, to each arm serving the config's
checkpoint, one server alive at a time:

  moonserve   `moonserve serve --config FILE`
  vllm        vLLM's OpenAI server with the same engine arguments (bench overhead's command),
              at vLLM's default structured outputs (backend `auto`), as its users run it

Every answer is one of: `valid` (200, JSON that validates against the schema as its `$schema`
draft reads it, formats checked), `refused` (400), `cut` (200 stopped at max_tokens: not judged),
`unenforced` (200, finished, and the content breaks the schema or is not JSON), `error` (any
other status). `unenforced` is the outcome a client cannot defend against (issue 36).

The schemas: the JSON Schema Test Suite (github.com/json-schema-org/JSON-Schema-Test-Suite, one
schema per test group), the first `--per-file` groups of each keyword's file in each `--suite`
folder; or `--schemas FILE`, a JSON list of {"name", "schema"}.

    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite /tmp/jsts
    moonserve bench structured --suite /tmp/jsts/tests/draft2020-12 /tmp/jsts/tests/draft7 \\
        --per-file 2 --out bench-structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config

ARMS = ("moonserve", "vllm")
OUTCOMES = ("valid", "refused", "cut", "unenforced", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Ray Serve config file")
    parser.add_argument("--out", default="bench-structured.json", help="JSON results file")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--suite", nargs="*", default=[],
                        help="folders of the JSON Schema Test Suite (e.g. tests/draft2020-12)")
    parser.add_argument("--per-file", type=int, default=2,
                        help="schemas (test groups) taken from each suite file")
    parser.add_argument("--schemas", help='a JSON file: [{"name": ..., "schema": {...}}, ...]')
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--port", type=int, default=8200,
                        help="vLLM's port; moonserve takes PORT+1, its dashboard PORT+2")


def load_schemas(args) -> list[dict]:
    """[{"name", "schema"}] from --schemas and --suite; only object schemas (response_format
    takes an object)."""
    found = json.loads(Path(args.schemas).read_text()) if args.schemas else []
    for folder in args.suite:
        for path in sorted(Path(folder).glob("*.json")):
            for group in json.loads(path.read_text())[:args.per_file]:
                found.append({"name": f"{Path(folder).name}/{path.stem}: {group['description']}",
                              "schema": group["schema"]})
    if not found:
        raise SystemExit("moonserve bench structured: give --suite FOLDER... or --schemas FILE")
    return [s for s in found if isinstance(s["schema"], dict)]


def request_body(model: str, schema: dict, max_tokens: int) -> dict:
    prompt = f"Reply with one JSON value that matches this JSON Schema:\n{json.dumps(schema)}"
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema,
                                                "strict": True}}}


def judge(schema: dict, status: int, body: dict) -> tuple[str, str]:
    """(outcome, detail) of one answer."""
    import referencing.exceptions
    from jsonschema import FormatChecker
    from jsonschema.validators import Draft202012Validator, validator_for

    if status == 400:
        return "refused", body.get("error", {}).get("message", "")[:300]
    if status != 200:
        return "error", f"{status}: {json.dumps(body)[:300]}"
    choice = body["choices"][0]
    content = choice["message"].get("content") or ""
    if choice["finish_reason"] == "length":
        return "cut", content[:200]
    try:
        answer = json.loads(content)
    except ValueError as exc:
        return "unenforced", f"not JSON ({exc}): {content[:200]}"
    validator = validator_for(schema, default=Draft202012Validator)(
        schema, format_checker=FormatChecker())
    try:
        errors = [e.message for e in validator.iter_errors(answer)]
    except referencing.exceptions.Unresolvable as exc:
        # A remote $ref nobody fetched: a 200 answered without holding that part of the schema.
        return "unenforced", f"unresolvable $ref {exc}: {content[:200]}"
    return ("unenforced", f"{errors[0]}: {content[:200]}") if errors else ("valid", content[:200])


async def measure_arm(base_url: str, model: str, schemas: list[dict], args) -> list[dict]:
    import httpx

    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(item: dict) -> dict:
            async with gate:
                r = await client.post("/v1/chat/completions",
                                      json=request_body(model, item["schema"], args.max_tokens))
            try:
                body = r.json()
            except ValueError:
                body = {"raw": r.text[:300]}
            outcome, detail = judge(item["schema"], r.status_code, body)
            return {"name": item["name"], "status": r.status_code, "outcome": outcome,
                    "detail": detail}

        return list(await asyncio.gather(*(one(item) for item in schemas)))


def servers(args, logs: Path):
    """(arm, ServerProcess) in --arms order; the caller starts and stops each."""
    from moonserve.deployments.builder import resolve_model_path
    from moonserve.pipeline.bench.overhead import vllm_command

    config = load_app_config(args.config).language_model
    for arm in args.arms:
        if arm == "moonserve":
            yield arm, ServerProcess(
                [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config",
                 args.config, "--port", str(args.port + 1), "--dashboard-port", str(args.port + 2)],
                f"http://127.0.0.1:{args.port + 1}/health", logs / "moonserve.log")
        else:
            yield arm, ServerProcess(
                vllm_command(config.engine, resolve_model_path(config), args.port,
                             structured_outputs=None),
                f"http://127.0.0.1:{args.port}/health", logs / "vllm.log", env=dict(config.env))


def counts(rows: list[dict]) -> dict[str, int]:
    tally = Counter(r["outcome"] for r in rows)
    return {outcome: tally.get(outcome, 0) for outcome in OUTCOMES}


def main(args: argparse.Namespace) -> int:
    schemas = load_schemas(args)
    model = load_app_config(args.config).language_model.engine.model_name()
    arms: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp:
        for arm, server in servers(args, Path(tmp)):
            with server:
                arms[arm] = asyncio.run(measure_arm(server.base_url, model, schemas, args))
    result = {"benchmark": "structured", "config": args.config, "model": model,
              "schemas": len(schemas), "max_tokens": args.max_tokens,
              "counts": {arm: counts(rows) for arm, rows in arms.items()}, "answers": arms}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'arm':<11}" + "".join(f"{o:>11}" for o in OUTCOMES) + f"  ({len(schemas)} schemas)")
    for arm, tally in result["counts"].items():
        print(f"{arm:<11}" + "".join(f"{tally[o]:>11}" for o in OUTCOMES))
    print(f"results written to {args.out}")
    return 0
