"""DraftService deployment: per-request draft contexts and the drafters (`ngram`, `dspark`, ...).

The engine's proposer sends one message per engine step with the whole batch (format in
`moonserve.pipeline.speculative.wire`) over a ZeroMQ connection to this replica's `StepServer`
(`moonserve.pipeline.speculative.endpoint`; `endpoint()` tells the LM replica where it is). The step
server answers on one thread, the sessions are behind one lock, and right after a step is answered
the same thread prefetches the next step (`DraftCore.prefetch`), which overlaps with the target verifying
this one. The replica's event loop only serves Serve calls. Idle sessions are evicted every few
seconds. The proposer's own counters arrive with each step and are exported here.

Example (without Serve):
    >>> service = DraftService(DraftConfig(mode="service"), "/path/to/dspark", "/path/to/target")
    >>> await service.endpoint()            # {"endpoint": "10.0.0.5:40123", "token": "..."}
    >>> # a proposer then sends each step there (`moonserve.pipeline.speculative.endpoint`)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import statistics
import threading
from collections import deque

from moonserve.pipeline.config import DraftConfig
from moonserve.pipeline.speculative.drafter import NoDrafter
from moonserve.pipeline.speculative.endpoint import StepServer
from moonserve.pipeline.speculative.ngram import NgramDrafter
from moonserve.pipeline.speculative.service import DraftCore, StepObservation
from moonserve.pipeline.speculative.suffix import SuffixDrafter

logger = logging.getLogger("moonserve.draft")
EVICT_INTERVAL_S = 5.0


def drafter_factories(config: DraftConfig, draft_model_path: str, target_path: str) -> dict:
    """Drafter factories by name, called at each `set_drafter`: `ngram`, `suffix`, `dspark`
    (weights at `draft_model_path`, embedding and LM head shared from the target checkpoint at
    `target_path`), `none` (no drafts: speculation paused) and, when it is the configured
    drafter, `dspark_context` (K3 DSpark over the target's hidden states, same weights path)."""
    def device() -> str:
        import torch

        return "cuda" if config.num_gpus and torch.cuda.is_available() else "cpu"

    @functools.cache  # the weights load once; the drafter keeps nothing per request
    def dspark():
        from moonserve.pipeline.models.dspark import target_shared_tensors
        from moonserve.pipeline.speculative.dspark import DSparkDrafter

        return DSparkDrafter.from_pretrained(draft_model_path, device=device(),
                                             shared=target_shared_tensors(target_path))

    @functools.cache
    def dspark_context():
        from moonserve.pipeline.models.dspark import target_shared_tensors
        from moonserve.pipeline.speculative.dspark_context import ContextDSparkDrafter

        return ContextDSparkDrafter.from_pretrained(draft_model_path, device=device(),
                                                    shared=target_shared_tensors(target_path))

    def suffix(**settings):  # `settings`: fields of draft.suffix to override
        return SuffixDrafter(dataclasses.replace(config.suffix, **settings))

    drafters = {"ngram": lambda: NgramDrafter(min_n=config.ngram_min, max_n=config.ngram_max),
                "suffix": suffix, "dspark": dspark, "none": NoDrafter}
    if config.drafter == "dspark_context":  # only then do the proposers send hidden states
        drafters["dspark_context"] = dspark_context
    return drafters


class DraftMetrics:
    def __init__(self):
        from moonserve.pipeline.metrics import make_metric

        names = ("moonserve_draft_step_seconds", "moonserve_draft_call_seconds",
                 "moonserve_draft_tokens", "moonserve_draft_accepted_tokens",
                 "moonserve_draft_prefetch", "moonserve_draft_fallbacks",
                 "moonserve_draft_quiet_rows", "moonserve_draft_min_acceptance")
        self.m = {name: make_metric(name) for name in names}

    def proposer_stats(self, stats: dict) -> None:
        """What the engine's proposer measured since its last step: round trips, fallbacks."""
        for seconds in stats.get("rtt_s", ()):
            self.m["moonserve_draft_call_seconds"].observe(seconds)
        for reason in ("missed", "skipped"):
            if stats.get(reason):
                self.m["moonserve_draft_fallbacks"].inc(stats[reason], tags={"reason": reason})
        if stats.get("quiet"):
            self.m["moonserve_draft_quiet_rows"].inc(stats["quiet"])

    def observe(self, o: StepObservation) -> None:
        tags = {"drafter": o.drafter}
        self.m["moonserve_draft_step_seconds"].observe(o.seconds, tags=tags)
        for n in o.num_drafts:
            self.m["moonserve_draft_tokens"].observe(n, tags=tags)
        for n in o.accepted:
            self.m["moonserve_draft_accepted_tokens"].observe(n, tags=tags)
        for result, count in (("hit", o.prefetch_hits), ("miss", o.prefetch_misses)):
            if count:
                self.m["moonserve_draft_prefetch"].inc(count, tags={**tags, "result": result})
        if o.num_resends:
            self.m["moonserve_draft_fallbacks"].inc(o.num_resends, tags={"reason": "resend"})
        self.m["moonserve_draft_min_acceptance"].set(o.min_acceptance)


class DraftService:
    def __init__(self, config: DraftConfig, draft_model_path: str, target_path: str):
        import torch

        # Drafting shares the node with the engine: nothing parallel inside one draft step.
        torch.set_num_threads(1)
        # Below 1 GPU, a share of one a LanguageModel rank also holds: the drafter may take that
        # share of its memory and no more (`moonserve plan` counts it beside vLLM's share).
        self.gpu_share = config.num_gpus if 0 < config.num_gpus < 1 else 1.0
        if self.gpu_share < 1 and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(self.gpu_share)
        self.config = config
        self.core = DraftCore(drafter_factories(config, draft_model_path, target_path),
                              config.drafter, config.sessions, prefetch=config.prefetch,
                              adaptive=config.adaptive)
        self.lock = threading.Lock()  # the core is used by one thread at a time
        self.metrics = DraftMetrics()
        self.recent_rtt_s: deque[float] = deque(maxlen=4096)
        self.steps = StepServer(self.serve_step, host=node_address())
        self.steps.start()
        self.evictor: asyncio.Task | None = None

    def serve_step(self, message: dict):
        """One step from a proposer (on the step server's thread); prefetch runs after the reply."""
        stats = message.pop("stats", None) or {}
        self.recent_rtt_s.extend(stats.get("rtt_s", ()))
        self.metrics.proposer_stats(stats)
        with self.lock:
            reply, observation = self.core.step(message)
        self.metrics.observe(observation)
        return reply, self.prefetch

    def prefetch(self) -> None:
        with self.lock:
            self.core.prefetch()

    async def endpoint(self, shard: int | None = None) -> dict:
        """Where proposers send steps: `{"endpoint": "host:port", "token": secret}`. `shard`
        only steers the call to that shard's replica (`ShardRouter`); any replica serves any
        request."""
        if self.evictor is None:
            self.evictor = asyncio.get_running_loop().create_task(self.evict_forever())
        return self.steps.endpoint()

    async def set_drafter(self, name: str, adaptive: bool | None = None,
                          shard: int | None = None, settings: dict | None = None,
                          prefetch: bool | None = None) -> dict:
        """Switch drafters (all sessions restart from the next step), and adaptive drafting and
        prefetching on or off when `adaptive` / `prefetch` are given (`draft.adaptive` and
        `draft.prefetch` otherwise); `settings` override the drafter's configured ones (`suffix`
        only: fields of `draft.suffix`, e.g. `{"max_spec_factor": 4}`). Benchmarks compare these
        on one engine. Returns `stats()`."""
        policy = self.config.adaptive if adaptive is None else \
            dataclasses.replace(self.config.adaptive, enabled=adaptive)
        await asyncio.to_thread(self._locked, self.core.set_drafter, name, policy, settings,
                                self.config.prefetch if prefetch is None else prefetch)
        self.recent_rtt_s.clear()  # `stats()` round trips are the active drafter's
        return await self.stats()

    async def set_deadline(self, deadline_ms: float | None, shard: int | None = None) -> None:
        """Tell the engines' proposers to wait up to `deadline_ms` per draft call from their next
        step on (None: back to `draft.deadline_ms`); for a drafter slower than the configured
        budget, e.g. the embedded DSpark drafter on CPU in tests and benchmarks."""
        self.core.deadline_ms = deadline_ms if deadline_ms is not None else self.config.deadline_ms

    async def stats(self, shard: int | None = None) -> dict:
        """This replica's sessions and drafting counters (`shard`: that shard's replica)."""
        summary = await asyncio.to_thread(self._locked, self.core.summary)
        rtt_ms = [1000 * s for s in self.recent_rtt_s]
        if len(rtt_ms) >= 2:
            cuts = statistics.quantiles(rtt_ms, n=100, method="inclusive")
            summary |= {"call_ms_p50": cuts[49], "call_ms_p99": cuts[98]}
        return summary | gpu_report(self.gpu_share)

    async def evict_forever(self) -> None:
        while True:
            await asyncio.sleep(EVICT_INTERVAL_S)
            await asyncio.to_thread(self._locked, self.core.evict_idle)

    def _locked(self, fn, *args):
        with self.lock:
            return fn(*args)

    def __del__(self):
        steps = getattr(self, "steps", None)
        if steps is not None:
            steps.close()


def gpu_report(share: float) -> dict:
    """The GPU this replica drafts on, if any: its UUID, the most memory the drafter's allocator
    has reserved, and the cap on it (`share` of the GPU's memory)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu_uuid": None}
    props = torch.cuda.get_device_properties(0)
    return {"gpu_uuid": str(props.uuid),
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(0),
            "gpu_memory_cap_bytes": int(share * props.total_memory)}


def node_address() -> str:
    """This node's address in the Ray cluster (what an LM replica on another node reaches)."""
    import ray

    return ray.util.get_node_ip_address()
