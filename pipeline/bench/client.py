"""A streaming OpenAI-API client that measures per-request latency (TTFT, inter-token latency)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    completion_tokens: int
    # Gaps between content chunks (a chunk is one token unless the server merged several).
    inter_token_s: list[float] = field(default_factory=list)
    text: str = ""
    # (name, arguments JSON) of each tool call, in the order of their indices
    tool_calls: list[tuple[str, str]] = field(default_factory=list)


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    """POST a streaming chat completion and time it; raises on a non-200 answer or an error event.
    A chunk of content or of a tool call counts as a token's arrival."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    parts: list[str] = []
    calls: dict[int, tuple[str, str]] = {}
    tokens = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            delta = event["choices"][0]["delta"] if event["choices"] else {}
            for call in delta.get("tool_calls") or ():
                name, arguments = calls.get(call["index"], ("", ""))
                function = call.get("function") or {}
                calls[call["index"]] = (name + (function.get("name") or ""),
                                        arguments + (function.get("arguments") or ""))
            text = delta.get("content")
            if not text and not delta.get("tool_calls"):
                continue
            now = time.perf_counter()
            first = first or now
            if last is not None:
                gaps.append(now - last)
            last = now
            parts.append(text or "")
    end = time.perf_counter()
    return RequestResult((first or end) - began, end - began, tokens, gaps, "".join(parts),
                         [calls[i] for i in sorted(calls)])


async def run_load(url: str, bodies: list[dict], concurrency: int) -> tuple[list[RequestResult], float]:
    """Send every body with at most `concurrency` in flight; returns results (in the order of
    `bodies`) and wall seconds."""
    return await in_pool(bodies, concurrency, lambda http, body: stream_chat(http, url, body),
                         timeout_s=600)


async def in_pool(items: list, concurrency: int, work, timeout_s: float) -> tuple[list, float]:
    """`await work(http, item)` for every item, at most `concurrency` at a time over one aiohttp
    session (`timeout_s` for each request); returns the results in the order of `items`, and
    wall seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(items):
        queue.put_nowait(item)
    results: list = [None] * len(items)

    async def worker(http):
        while not queue.empty():
            index, item = queue.get_nowait()
            results[index] = await work(http, item)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        began = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return results, time.perf_counter() - began


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (a whole percent: 0.5, 0.99) with linear interpolation between the
    nearest ranks, as numpy's default; nan for no values.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.99)
        (2.5, 3.97)
    """
    percent = round(q * 100)
    if not 0 <= percent <= 100 or abs(q * 100 - percent) > 1e-9:
        raise ValueError(f"percentile q={q} is not a whole percent in [0, 1]")
    if len(values) < 2:  # statistics.quantiles needs two points (Python 3.11)
        return float(values[0]) if values else float("nan")
    # "inclusive": the data's min and max are the 0th and 100th percentiles.
    cuts = [min(values), *statistics.quantiles(values, n=100, method="inclusive"), max(values)]
    return cuts[percent]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ttft = [r.ttft_s for r in results]
    itl = [g for r in results for g in r.inter_token_s]
    tokens = sum(r.completion_tokens for r in results)
    return {
        "requests": len(results),
        "ttft_ms_p50": 1000 * percentile(ttft, 0.5),
        "ttft_ms_p99": 1000 * percentile(ttft, 0.99),
        "itl_ms_p50": 1000 * percentile(itl, 0.5),
        "e2e_ms_mean": 1000 * statistics.fmean(r.e2e_s for r in results),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s,
        "wall_s": wall_s,
    }
