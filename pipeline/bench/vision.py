"""Vision path: preprocessing vs vLLM's, packed encoder vs per-image loop, image vs text TTFT.

Three comparisons, both sides of each in this one run:
1. preprocessing images/s, ours vs vLLM's Kimi-K3 preprocessing, same images, equal outputs;
2. embedded MoonViT images/s, one packed batch vs a per-image loop, equal outputs, on a chat-like
   mix of image sizes and on a batch of small images (`vision_encoder.MIXES`);
3. end to end on `moonserve serve`: TTFT of a 1-image chat request vs the same text-only
   request (a new image each time, so the encoder cache does not answer).

    moonserve bench vision [--rounds 5] [--requests 12] [--skip-e2e] [--out bench-vision.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
from pathlib import Path

import aiohttp

from moonserve.pipeline.bench.client import percentile, stream_chat
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config
from moonserve.pipeline.app.launch import ServerProcess


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--rounds", type=int, default=5, help="alternations per comparison")
    parser.add_argument("--requests", type=int, default=12, help="end-to-end requests per arm")
    parser.add_argument("--skip-e2e", action="store_true", help="no server: arms 1 and 2 only")
    parser.add_argument("--port", type=int, default=8032)
    parser.add_argument("--out", default="bench-vision.json")


def image_body(model: str, png: bytes | None) -> dict:
    text = {"type": "text", "text": "Describe the picture in one sentence."}
    parts = [text] if png is None else [
        {"type": "image_url",
         "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}, text]
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 8,
            "temperature": 0}


async def ttft_arms(base_url: str, model: str, n: int) -> dict[str, list[float]]:
    """Alternate text-only and 1-image requests (448x448 PNGs, a new one each time)."""
    from moonserve.pipeline.bench import vision_preprocess

    url = f"{base_url}/v1/chat/completions"
    ttft: dict[str, list[float]] = {"text": [], "image": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for i in range(n + 1):
            png = vision_preprocess.sample_image(448, 448, "PNG", seed=1000 + i)
            for arm, body in [("text", image_body(model, None)), ("image", image_body(model, png))]:
                result = await stream_chat(session, url, body)
                if i:  # the first pair warms both paths up
                    ttft[arm].append(1000 * result.ttft_s)
    return ttft


def end_to_end(args) -> dict:
    config = load_app_config(args.config)
    cmd = [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", args.config,
           "--port", str(args.port), "--dashboard-port", str(args.port + 150)]
    with tempfile.TemporaryDirectory(prefix="moonserve-bench-") as tmp, \
            ServerProcess(cmd, f"http://127.0.0.1:{args.port}/health",
                          Path(tmp) / "serve.log") as server:
        ttft = asyncio.run(ttft_arms(server.base_url, config.language_model.engine.model_name(),
                                     args.requests))
    summary = {arm: {"requests": len(v), "ttft_ms_p50": percentile(v, 0.5),
                     "ttft_ms_p99": percentile(v, 0.99)} for arm, v in ttft.items()}
    summary["image_minus_text_p50_ms"] = summary["image"]["ttft_ms_p50"] - \
        summary["text"]["ttft_ms_p50"]
    return summary


def main(args: argparse.Namespace) -> int:
    from moonserve.pipeline.bench import vision_encoder, vision_preprocess  # torch: imported on use

    result = {"benchmark": "vision", "rounds": args.rounds,
              "preprocess": vision_preprocess.run(vision_preprocess.sample_images(), args.rounds),
              "encoder": {mix: vision_encoder.run(grids, args.rounds)
                          for mix, grids in vision_encoder.MIXES.items()}}
    if not args.skip_e2e:
        result["end_to_end"] = end_to_end(args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "benchmark"}, indent=2)[:4000])
    print(f"results written to {args.out}")
    return 0
