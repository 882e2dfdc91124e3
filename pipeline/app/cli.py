"""`moonserve` command line: prepare, serve, bench, plan, check-checkpoint.

    moonserve prepare                      # build the embedded LM, vision encoder, drafter
    moonserve serve [--config FILE]        # local Ray + app on 127.0.0.1:8000, dashboard :8265
    moonserve bench overhead [--out FILE]  # pipeline vs vLLM's own OpenAI server, JSON results
    moonserve bench lanes [--out FILE]     # interactive TTFT under long-context load, lanes vs FIFO
    moonserve bench vision [--out FILE]    # preprocess vs vLLM, packed vs loop encoder, image TTFT
    moonserve bench reliability [--out FILE]  # 5x overload: sent/completed/rejected/lost; recovery
    moonserve bench speculative [--out FILE]  # decode tok/s: no spec, vLLM ngram, DraftService arms
    moonserve bench tools [--out FILE]     # BFCL tool calling: AST accuracy, schema validity, vs vLLM
    moonserve bench admission [--out FILE]  # latency of application-wide lanes vs a replica's own
    moonserve bench routing [--out FILE]   # two LM replicas: prefix-affinity vs Serve's router
    moonserve bench replay --trace FILE    # a Mooncake trace: goodput vs vLLM, 1 and 2 replicas
    moonserve bench structured --suite DIR  # json_schema answers: valid/refused/cut/unenforced
    moonserve plan [--json]                # capacity of Kimi K3.1 Pro + DSpark on 8x MI355X
    moonserve plan --checkpoint PATH       # ... with the weights measured in a checkpoint
    moonserve check-checkpoint PATH [--json] [--tp 8]  # preflight a checkpoint from its headers
    moonserve config-reference [--write docs/configuration.md]  # the config fields as Markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from moonserve.pipeline.config import DEFAULT_CONFIG


def cmd_prepare(args: argparse.Namespace) -> int:
    from moonserve.pipeline.prepare.drafter import prepare_drafter
    from moonserve.pipeline.prepare.language_model import prepare_language_model
    from moonserve.pipeline.prepare.vision_encoder import prepare_vision_encoder
    from moonserve.pipeline.prepare.wheels import BFCL_EVAL, fetch_wheel

    lm_path = prepare_language_model(progress=not args.quiet)
    print(lm_path)
    print(prepare_vision_encoder(lm_path))
    print(prepare_drafter(lm_path))
    # The tool-calling bench's data, so its tests run offline from here on.
    print(fetch_wheel(BFCL_EVAL, progress=not args.quiet))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from moonserve.pipeline.app.server import ServeOptions, run_until_signalled

    options = ServeOptions(
        config=Path(args.config), address=args.address, host=args.host, port=args.port,
        dashboard_port=args.dashboard_port, metrics_export_port=args.metrics_export_port,
    )
    try:
        return run_until_signalled(options)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        # Config mistakes (raised before Ray starts): the message names the key; no traceback.
        print(f"moonserve serve: error: {exc}", file=sys.stderr)
        return 2


def cmd_bench(args: argparse.Namespace) -> int:
    return BENCHMARKS[args.bench]().main(args)


def bench_module(name: str):
    """Imported when the parser is built; a benchmark module keeps torch, Ray and vLLM imports
    inside its `main`, so `moonserve --help` stays fast."""
    import importlib

    return lambda: importlib.import_module(f"moonserve.pipeline.bench.{name}")


BENCHMARKS = {"overhead": bench_module("overhead"), "lanes": bench_module("lanes"),
              "vision": bench_module("vision"), "reliability": bench_module("reliability"),
              "speculative": bench_module("speculative"), "tools": bench_module("tools"),
              "admission": bench_module("admission_latency"), "routing": bench_module("routing"),
              "structured": bench_module("structured"), "soak": bench_module("soak"),
              "sampling": bench_module("sampling"), "replay": bench_module("replay")}


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from moonserve.pipeline.capacity.plan import EngineLimits, draft_service_weight_bytes, plan
    from moonserve.pipeline.capacity.registry import (
        BRIEF_USED_BYTES_PER_GPU_AT_START,
        DRAFTS,
        HARDWARE,
        k3_kv_cache_settings,
    )
    from moonserve.pipeline.capacity.report import compare_with_brief, format_plan, plan_to_dict

    try:
        apply_config_to_plan(args)
        model = plan_model(args)
        if model is None:
            return 1
        draft = None if args.draft == "none" else DRAFTS[args.draft]
        service_weights = draft_service_weight_bytes(model, DRAFTS[args.draft_service_model]) \
            if args.draft_service_gpu_share and args.draft_service_model else 0.0
        kv_cache = k3_kv_cache_settings(args.num_speculative_tokens if draft else 0,
                                        args.enable_prefix_caching)
        result = plan(model, HARDWARE[args.hardware], args.tensor_parallel_size,
                      args.decode_context_parallel_size,
                      gpu_memory_utilization=args.gpu_memory_utilization, draft=draft,
                      kv_cache=kv_cache, limits=EngineLimits(
                          args.max_num_seqs, args.max_model_len,
                          None if args.draft_attention_backend == "auto"
                          else args.draft_attention_backend,
                          args.encoder_gpu_memory_utilization,
                          args.draft_service_gpu_share, service_weights))
    except (ValueError, FileNotFoundError) as exc:
        print(f"moonserve plan: error: {exc}", file=sys.stderr)
        return 2
    # The brief's figure is printed beside the derived one with the residual; it is not a check.
    brief = compare_with_brief(result, BRIEF_USED_BYTES_PER_GPU_AT_START)
    if args.json:
        print(json.dumps({**plan_to_dict(result),
                          "brief_comparison": dataclasses.asdict(brief)}, indent=2))
    else:
        print(format_plan(result, brief))
    return 0


def apply_config_to_plan(args: argparse.Namespace) -> None:
    """--config: the parallelism and memory settings of that config's LanguageModel engine."""
    if args.config is None:
        return
    from moonserve.pipeline.config import load_app_config

    app = load_app_config(args.config)
    engine, draft = app.language_model.engine, app.draft
    args.tensor_parallel_size = engine.tensor_parallel_size
    args.decode_context_parallel_size = engine.decode_context_parallel_size
    args.gpu_memory_utilization = engine.gpu_memory_utilization
    args.enable_prefix_caching = engine.enable_prefix_caching
    args.max_model_len, args.max_num_seqs = engine.max_model_len, engine.max_num_seqs
    # An inline DSpark draft is part of the engine; a DraftService asking for part of a GPU
    # sits beside a TP rank (its weights: the K3 DSpark draft's, none for a model-free drafter).
    if draft.mode == "inline" and draft.drafter == "dspark":
        args.num_speculative_tokens = draft.num_speculative_tokens
        args.draft_attention_backend = draft.attention_backend or "auto"
    else:
        args.draft = "none"
    args.draft_service_gpu_share = draft.num_gpus \
        if draft.mode == "service" and 0 < draft.num_gpus < 1 else 0.0
    if draft.drafter not in ("dspark", "dspark_context"):
        args.draft_service_model = None
    # The encoder engine shares a GPU with a TP rank when it asks for part of one.
    encoder = app.vision.encoder if app.vision and app.vision.handover == "encoder_cache" \
        else None
    args.encoder_gpu_memory_utilization = encoder.gpu_memory_utilization \
        if encoder is not None and 0 < encoder.num_gpus < 1 else 0.0
    print(f"plan: engine settings from {args.config}: tensor_parallel_size "
          f"{engine.tensor_parallel_size}, decode_context_parallel_size "
          f"{engine.decode_context_parallel_size}, gpu_memory_utilization "
          f"{engine.gpu_memory_utilization}, enable_prefix_caching "
          f"{engine.enable_prefix_caching}, max_model_len {engine.max_model_len}, max_num_seqs "
          f"{engine.max_num_seqs}, draft {args.draft} (k={args.num_speculative_tokens}, "
          f"attention {args.draft_attention_backend}; sized as the K3 DSpark draft), encoder "
          "share of one GPU "
          f"{args.encoder_gpu_memory_utilization}, DraftService share of one GPU "
          f"{args.draft_service_gpu_share}", file=sys.stderr)


def plan_model(args: argparse.Namespace):
    """The nominal model, or with --checkpoint the measured one; None when the check fails."""
    from moonserve.pipeline.capacity.checkpoint import check_checkpoint, format_report
    from moonserve.pipeline.capacity.plan import with_checkpoint
    from moonserve.pipeline.capacity.registry import MODELS

    if args.checkpoint is None:
        return MODELS[args.model]
    report = check_checkpoint(args.checkpoint, args.tensor_parallel_size)
    if not report.ok:
        print(format_report(report), file=sys.stderr)
        return None
    return with_checkpoint(MODELS[args.model], report)


def cmd_check_checkpoint(args: argparse.Namespace) -> int:
    import json

    from moonserve.pipeline.capacity.checkpoint import check_checkpoint, format_report, report_to_dict

    if args.tp < 1:
        print(f"moonserve check-checkpoint: error: --tp {args.tp}: must be >= 1", file=sys.stderr)
        return 2
    try:
        report = check_checkpoint(args.path, args.tp)
    except FileNotFoundError as exc:
        print(f"moonserve check-checkpoint: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report_to_dict(report), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def cmd_config_reference(args: argparse.Namespace) -> int:
    from moonserve.pipeline.config_reference import render, write

    if args.write is None:
        print(render().strip("\n"))
        return 0
    try:
        changed = write(Path(args.write))
    except (ValueError, FileNotFoundError) as exc:
        print(f"moonserve config-reference: error: {args.write}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.write}: {'updated' if changed else 'already up to date'}")
    return 0


CHECK_CHECKPOINT_HELP = """\
Preflight a safetensors checkpoint from its headers alone (no tensor data is read).

PATH is a directory (config.json, model.safetensors.index.json and its shards, or one
.safetensors file) or a single .safetensors file. Pairs MXFP4 blocks with their E8M0 scales and
FP8 weights with theirs; with a Kimi K3 (or Kimi Linear) config.json beside it, checks that every
tensor vLLM's loader expects is there with the right shape and dtype, and reports parameters and
bytes by component and format, in total and per TP rank (vLLM's sharding rules). With a DSpark
draft's config.json, it says which drafter vLLM makes of it (only a K3DSparkModel is K3's MLA
drafter, the one draft.attention_backend TRITON_MLA is for).

Exit status: 0 no problems (warnings allowed), 1 problems found (each names its file or tensor),
2 usage error (bad arguments, PATH does not exist)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moonserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="build the embedded LM checkpoint, the embedded "
                             "(random-weight) vision encoder and the embedded DSpark drafter under "
                             "$MOONSERVE_HOME (default ~/.cache/moonserve); idempotent")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=cmd_prepare)

    serve = sub.add_parser("serve", help="run the app (Ray Serve) until Ctrl-C/SIGTERM")
    serve.add_argument("--config", default=str(DEFAULT_CONFIG),
                       help="Ray Serve config file (default: configs/local.yaml)")
    serve.add_argument("--address", default=None,
                       help="connect to this Ray cluster instead of starting a local one (a "
                            "local one gets Serve's HAProxy mode for router.ingress: haproxy and "
                            "slower Serve timers, docs/configuration.md; a cluster you "
                            "start needs them on each `ray start`)")
    serve.add_argument("--host", default=None, help="HTTP host (default: the config's, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's, 8000)")
    serve.add_argument("--dashboard-port", type=int, default=8265,
                       help="Ray dashboard port of a local cluster (default 8265)")
    serve.add_argument("--metrics-export-port", type=int, default=None,
                       help="Prometheus port of a local cluster's Ray node (default: Ray picks "
                       "one; the URL is printed at start)")
    serve.set_defaults(func=cmd_serve)

    from moonserve.pipeline.capacity.registry import (
        DRAFTS,
        HARDWARE,
        K3_DRAFT_ATTENTION_BACKEND,
        K3_ENCODER_GPU_MEMORY_UTILIZATION,
        K3_MAX_NUM_SEQS,
        MODELS,
    )

    plan = sub.add_parser("plan", help="capacity plan: weights, KV/state, concurrency, roofline, "
                          "beside the brief's ~199 GB/GPU")
    plan.add_argument("--model", choices=sorted(MODELS), default="kimi-k3.1-pro")
    plan.add_argument("--draft", choices=[*sorted(DRAFTS), "none"], default="kimi-k3-dspark",
                      help="speculative draft whose weights and MLA KV the engine holds "
                      "(default: the K3 recipes' DSpark draft)")
    plan.add_argument("--num-speculative-tokens", type=int, default=7,
                      help="draft tokens per step (default 7, the K3 DSpark recipes'); sizes the "
                      "KDA conv state and its per-sequence state pages")
    plan.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                      default=True, help="vLLM then keeps KDA state in 'align' mode (more pages "
                      "per sequence); --config takes it from the engine")
    plan.add_argument("--hardware", choices=sorted(HARDWARE), default="mi355x")
    plan.add_argument("--tensor-parallel-size", type=int, default=8)
    plan.add_argument("--decode-context-parallel-size", type=int, default=1)
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    plan.add_argument("--max-model-len", type=int, default=None,
                      help="the longest request (default: the model's 1,048,576); the plan "
                      "refuses one that would not fit the KV pool, as vLLM refuses to start")
    plan.add_argument("--max-num-seqs", type=int, default=K3_MAX_NUM_SEQS,
                      help=f"vLLM's max_num_seqs (default {K3_MAX_NUM_SEQS}); sizes a TRITON_MLA "
                      "draft's workspace")
    plan.add_argument("--draft-attention-backend", choices=["TRITON_MLA", "auto"],
                      default=K3_DRAFT_ATTENTION_BACKEND,
                      help="the draft's attention backend (default TRITON_MLA, the production "
                      "config's): TRITON_MLA adds its split-KV workspace, outside "
                      "gpu_memory_utilization")
    plan.add_argument("--encoder-gpu-memory-utilization", type=float,
                      default=K3_ENCODER_GPU_MEMORY_UTILIZATION,
                      help="the VisionEncoder engine's share of one of these GPUs (default "
                      f"{K3_ENCODER_GPU_MEMORY_UTILIZATION}, the production config's; 0: none)")
    plan.add_argument("--draft-service-gpu-share", type=float, default=0.0, metavar="SHARE",
                      help="the DraftService's share of one of these GPUs (draft.num_gpus below "
                      "1 with draft.mode service: also its memory cap), sized as the K3 DSpark "
                      "draft with its own embedding and LM head (default 0: not on these GPUs)")
    plan.add_argument("--json", action="store_true", help="JSON instead of tables")
    plan.add_argument("--config", metavar="FILE", default=None,
                      help="take the engine settings from this Ray Serve config (e.g. "
                      "configs/mi355x-k3.1-pro.yaml): parallel sizes, GPU memory utilization, "
                      "prefix caching, max_model_len, max_num_seqs, the draft and its backend, "
                      "the encoder's GPU share; overrides those flags")
    plan.add_argument("--checkpoint", metavar="PATH", default=None,
                      help="plan with the weights check-checkpoint measures in PATH (bytes per GPU "
                      "as stored, vLLM's TP rules) and its config.json's layer and expert counts; "
                      "exits 1 if the check finds problems")
    plan.set_defaults(func=cmd_plan, draft_service_model="kimi-k3-dspark")

    check = sub.add_parser("check-checkpoint", help="preflight a safetensors checkpoint from its "
                           "headers: expected tensors, shapes, MXFP4 scales, bytes per TP rank",
                           description=CHECK_CHECKPOINT_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("path", metavar="PATH", help="checkpoint directory or .safetensors file")
    check.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=8,
                       help="tensor-parallel size for the bytes per rank (default 8)")
    check.add_argument("--json", action="store_true", help="JSON report instead of tables")
    check.set_defaults(func=cmd_check_checkpoint)

    reference = sub.add_parser("config-reference", help="the config's fields (key, type, default, "
                               "description) as Markdown tables, from pipeline/config.py")
    reference.add_argument("--write", metavar="PAGE", default=None,
                           help="replace the generated part of PAGE (between its marker lines, "
                           "e.g. docs/configuration.md) instead of printing")
    reference.set_defaults(func=cmd_config_reference)

    bench = sub.add_parser("bench", help="benchmarks (JSON results)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module in BENCHMARKS.items():
        mod = module()
        mod.add_arguments(bench_sub.add_parser(name, help=mod.__doc__.split("\n")[0],
                                               description=mod.__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

if __name__ == "__main__":
    sys.exit(main())
