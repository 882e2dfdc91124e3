"""`moonserve` command line: prepare, serve, bench.

    moonserve prepare                      # build the embedded checkpoint (idempotent)
    moonserve serve [--config FILE]        # local Ray + app on 127.0.0.1:8000, dashboard :8265
    moonserve bench overhead [--out FILE]  # pipeline vs vLLM's own OpenAI server, JSON results
    moonserve plan [--json]                # capacity of Kimi K3.1 Pro on 8x MI355X
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG


def cmd_prepare(args: argparse.Namespace) -> int:
    from pipeline.embedded import prepare_language_model

    print(prepare_language_model(progress=not args.quiet))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from pipeline.server import ServeOptions, run_until_signalled

    options = ServeOptions(
        config=Path(args.config), address=args.address, host=args.host, port=args.port,
        dashboard_port=args.dashboard_port,
    )
    try:
        return run_until_signalled(options)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        # Config mistakes (raised before Ray starts): the message names the key; no traceback.
        print(f"moonserve serve: error: {exc}", file=sys.stderr)
        return 2


def cmd_bench(args: argparse.Namespace) -> int:
    from pipeline.bench import overhead

    return overhead.main(args)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from pipeline.plan import HARDWARE, MODELS, check_against_brief, format_plan, plan, plan_to_dict

    try:
        result = plan(MODELS[args.model], HARDWARE[args.hardware], args.tensor_parallel_size,
                      args.decode_context_parallel_size,
                      gpu_memory_utilization=args.gpu_memory_utilization)
    except ValueError as exc:
        print(f"moonserve plan: error: {exc}", file=sys.stderr)
        return 2
    violations = check_against_brief(result) if args.model == "kimi-k3.1-pro" else []
    if args.json:
        print(json.dumps({**plan_to_dict(result), "brief_violations": violations}, indent=2))
    else:
        print(format_plan(result))
        print("\n".join(f"brief check: {v}" for v in violations) or "brief check: ok")
    return 1 if violations else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moonserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="build the embedded model checkpoint under "
                             "$MOONSERVE_HOME (default ~/.cache/moonserve); idempotent")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=cmd_prepare)

    serve = sub.add_parser("serve", help="run the app (Ray Serve) until Ctrl-C/SIGTERM")
    serve.add_argument("--config", default=str(DEFAULT_CONFIG),
                       help="Ray Serve config file (default: configs/local.yaml)")
    serve.add_argument("--address", default=None,
                       help="connect to this Ray cluster instead of starting a local one")
    serve.add_argument("--host", default=None, help="HTTP host (default: the config's, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's, 8000)")
    serve.add_argument("--dashboard-port", type=int, default=8265,
                       help="Ray dashboard port of a local cluster (default 8265)")
    serve.set_defaults(func=cmd_serve)

    from pipeline.plan import HARDWARE, MODELS

    plan = sub.add_parser("plan", help="capacity plan: weights, KV/state, concurrency, roofline")
    plan.add_argument("--model", choices=sorted(MODELS), default="kimi-k3.1-pro")
    plan.add_argument("--hardware", choices=sorted(HARDWARE), default="mi355x")
    plan.add_argument("--tensor-parallel-size", type=int, default=8)
    plan.add_argument("--decode-context-parallel-size", type=int, default=1)
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    plan.add_argument("--json", action="store_true", help="JSON instead of tables")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="benchmarks (JSON results)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from pipeline.bench import overhead

    overhead.add_arguments(bench_sub.add_parser("overhead", help=overhead.__doc__.split("\n")[0]))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

if __name__ == "__main__":
    sys.exit(main())
