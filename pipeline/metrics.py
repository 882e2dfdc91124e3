"""moonserve's own metrics, exported through Ray's metrics agent (Prometheus, Ray dashboard).

Every metric is declared once in `METRICS`; Prometheus shows it as `ray_<name>` (counters with a
`_total` suffix), with Serve's `deployment`, `replica` and `application` tags added by
`ray.serve.metrics`. docs/metrics.md lists the same names; `tests/server/test_metrics.py` checks that the
running app exports them.

Example (inside a replica):
    >>> metrics = RouterMetrics()
    >>> metrics.lane_event("interactive", "admitted")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Seconds: 5 ms .. 5 min, dense where interactive TTFT and inter-token latency live.
LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                        5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]


# Token counts per step (drafts per row, accepted drafts per verified row).
COUNT_BOUNDARIES = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 12.5, 16.5]


@dataclass(frozen=True)
class MetricSpec:
    kind: str  # counter | gauge | histogram
    description: str
    tag_keys: tuple[str, ...] = ("lane",)
    boundaries: tuple[float, ...] = tuple(LATENCY_BOUNDARIES_S)


METRICS: dict[str, MetricSpec] = {
    "moonserve_lane_queue_depth": MetricSpec("gauge", "Requests waiting in the lane's queue."),
    "moonserve_lane_in_flight": MetricSpec("gauge", "Admitted requests of the lane, generating."),
    "moonserve_lane_requests": MetricSpec(
        "counter", "Lane admission outcomes (event: admitted | rejected | timed_out).",
        ("lane", "event")),
    "moonserve_time_to_first_token_seconds": MetricSpec(
        "histogram", "Request arrival at the router to the first generated token (queueing "
        "included)."),
    "moonserve_inter_token_latency_seconds": MetricSpec(
        "histogram", "Time between generated tokens of one request, as streamed by the router."),
    "moonserve_request_latency_seconds": MetricSpec(
        "histogram", "Request arrival to the last token, by lane and outcome (status: ok | error).",
        ("lane", "status")),
    "moonserve_prompt_tokens": MetricSpec("counter", "Prompt tokens of admitted requests."),
    "moonserve_completion_tokens": MetricSpec("counter", "Generated tokens."),
    "moonserve_image_preprocess_seconds": MetricSpec(
        "histogram", "ImagePreprocessor: one image from URL to patches (fetch, decode, resize, "
        "patchify).", ()),
    "moonserve_image_encode_seconds": MetricSpec(
        "histogram", "VisionEncoder: one packed batch through MoonViT (observed per image).", ()),
    "moonserve_encoder_cache": MetricSpec(
        "counter", "VisionEncoder embedding cache lookups (result: hit | miss).", ("result",)),
    "moonserve_draft_step_seconds": MetricSpec(
        "histogram", "DraftService: drafting one engine step's batch (critical path only).",
        ("drafter",)),
    "moonserve_draft_call_seconds": MetricSpec(
        "histogram", "LanguageModel: round trip of one draft call as the engine step waits for it.",
        ()),
    "moonserve_draft_tokens": MetricSpec(
        "histogram", "DraftService: draft tokens proposed per request per step.", ("drafter",),
        tuple(COUNT_BOUNDARIES)),
    "moonserve_draft_accepted_tokens": MetricSpec(
        "histogram", "DraftService: drafts the target accepted per verified step (acceptance "
        "length).", ("drafter",), tuple(COUNT_BOUNDARIES)),
    "moonserve_draft_prefetch": MetricSpec(
        "counter", "DraftService: steps answered from a prefetch (result: hit | miss).",
        ("drafter", "result")),
    "moonserve_lm_routing_decisions": MetricSpec(
        "counter", "LanguageModel replica choices of the prefix-affinity router (decision: "
        "affinity = longest known prefix | cache_key = the request's prompt_cache_key | "
        "fallback = power of two choices | single = one replica).", ("decision",)),
    "moonserve_draft_fallbacks": MetricSpec(
        "counter", "Engine steps without drafts because of the DraftService (reason: missed = "
        "past the deadline | skipped = a call still pending or no connection | error = the "
        "service call failed | resend = context lost by the service).", ("reason",)),
    "moonserve_draft_min_acceptance": MetricSpec(
        "gauge", "The acceptance a draft needs at the last step: what pays for its verify cost at "
        "the engine's load (the proposer's step-cost model, b x tokens/s), or "
        "draft.adaptive.min_acceptance until the model has it; past 1 nothing is drafted.", ()),
    "moonserve_draft_quiet_rows": MetricSpec(
        "counter", "Engine step rows the proposer left out of its DraftService calls: their "
        "request was in an adaptive pause (drafting nothing), so no round trip for it.", ()),
}


def make_metric(name: str):
    from ray.serve import metrics

    spec = METRICS[name]
    if spec.kind == "counter":
        return metrics.Counter(name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind == "gauge":
        return metrics.Gauge(name, description=spec.description, tag_keys=spec.tag_keys)
    return metrics.Histogram(name, description=spec.description, tag_keys=spec.tag_keys,
                             boundaries=list(spec.boundaries))


# Completion tokens are counted per lane in the replica and added to the Ray counter at most this
# often (and when a request ends): one Ray call for many tokens, where Ray exports every few
# seconds anyway. Measured before: the per-token `inc` was about a ninth of a Router's event loop
# at 64 streams (py-spy, tiny engine).
TOKEN_COUNT_PERIOD_S = 1.0


class RouterMetrics:
    """The Router's metrics; also the `LaneObserver` of its lanes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.m = {name: make_metric(name) for name in METRICS}
        self.clock = clock
        self.unsent_tokens: dict[str, int] = {}  # lane -> completion tokens not yet in the counter
        self.tokens_sent_at = clock()

    def lane_depth(self, lane: str, queued: int, in_flight: int) -> None:
        self.m["moonserve_lane_queue_depth"].set(queued, tags={"lane": lane})
        self.m["moonserve_lane_in_flight"].set(in_flight, tags={"lane": lane})

    def lane_event(self, lane: str, event: str) -> None:
        self.m["moonserve_lane_requests"].inc(tags={"lane": lane, "event": event})

    def prompt(self, lane: str, num_tokens: int) -> None:
        self.m["moonserve_prompt_tokens"].inc(num_tokens, tags={"lane": lane})

    def first_token(self, lane: str, seconds: float) -> None:
        self.m["moonserve_time_to_first_token_seconds"].observe(seconds, tags={"lane": lane})

    def tokens(self, lane: str, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` arrived in one delta `gap_s` after the previous one (None: the first)."""
        if num_tokens <= 0:
            return
        self.unsent_tokens[lane] = self.unsent_tokens.get(lane, 0) + num_tokens
        if self.clock() - self.tokens_sent_at >= TOKEN_COUNT_PERIOD_S:
            self.send_tokens()
        if gap_s is not None:
            # A delta can carry several tokens (vLLM merges unread deltas): spread the gap.
            itl = self.m["moonserve_inter_token_latency_seconds"]
            for _ in range(num_tokens):
                itl.observe(gap_s / num_tokens, tags={"lane": lane})

    def send_tokens(self) -> None:
        """The completion tokens counted since the last call, into the Ray counter."""
        unsent, self.unsent_tokens = self.unsent_tokens, {}
        self.tokens_sent_at = self.clock()
        for lane, num_tokens in unsent.items():
            self.m["moonserve_completion_tokens"].inc(num_tokens, tags={"lane": lane})

    def finished(self, lane: str, seconds: float, ok: bool) -> None:
        self.send_tokens()
        self.m["moonserve_request_latency_seconds"].observe(
            seconds, tags={"lane": lane, "status": "ok" if ok else "error"})


class RequestTrace:
    """Times one request from its arrival at the router; feeds TTFT, ITL and latency metrics."""

    def __init__(self, metrics: RouterMetrics | None, lane: str, arrival: float,
                 on_finish: Callable[[int], object] | None = None):
        self.metrics = metrics
        self.lane = lane
        self.arrival = arrival
        self.on_finish = on_finish  # called with the completion tokens when the request ends
        self.num_tokens = 0
        self.last: float | None = None
        self.failed = False  # the LM call raised (a stream may still end "normally" after it)

    def delta(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        if self.metrics is None or num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.first_token(self.lane, now - self.arrival)
        self.metrics.tokens(self.lane, num_tokens, None if self.last is None else now - self.last)
        self.last = now

    def finish(self, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.finished(self.lane, time.monotonic() - self.arrival, ok and not self.failed)
        if self.on_finish is not None:
            self.on_finish(self.num_tokens)
