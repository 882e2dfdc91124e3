"""Latency application-wide lanes add to each request: a Router replica's own lanes vs the
LaneAdmission replica (`router.lanes.scope: application` with several Router replicas).

Both arms are timed in one run, inside one Serve replica as a Router would call them, with no
engine: each request admits into the interactive lane and releases at once (the lane never fills,
so what is timed is the admission path alone). `replica`: the Router's own `Lanes`; `application`:
`SharedLanes`, one call to the LaneAdmission replica per admit plus one, not awaited, per release.

    moonserve bench admission [--requests 2000] [--concurrency 1 16] [--out bench-admission.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from moonserve.pipeline.bench.client import percentile

ARMS = ("replica", "application")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="admissions per arm and level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warmup", type=int, default=100, help="untimed admissions per arm")
    parser.add_argument("--out", default="bench-admission.json", help="JSON results file")


class Probe:
    """Admits and releases through either arm's lanes, as the Router does."""

    def __init__(self, config, admission):
        from moonserve.pipeline.api.application_lanes import SharedLanes
        from moonserve.pipeline.api.lanes import Lanes

        self.arms = {"replica": Lanes(config), "application": SharedLanes(config, admission)}

    async def run(self, arm: str, requests: int, concurrency: int) -> dict:
        lanes = self.arms[arm]
        latencies: list[float] = []

        async def worker(count: int) -> None:
            for _ in range(count):
                began = time.perf_counter()
                slot = await lanes.admit("interactive")
                latencies.append(time.perf_counter() - began)
                slot.release()

        began = time.perf_counter()
        shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(worker(n) for n in shares))
        wall = time.perf_counter() - began
        return {"requests": requests, "concurrency": concurrency,
                "admit_p50_us": round(percentile(latencies, 0.5) * 1e6, 1),
                "admit_p99_us": round(percentile(latencies, 0.99) * 1e6, 1),
                "admit_mean_us": round(sum(latencies) / len(latencies) * 1e6, 1),
                "admissions_per_s": round(requests / wall, 1)}


def main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from moonserve.deployments.builder import bind_admission
    from moonserve.pipeline.config import LaneLimits, LanesConfig

    # Room over the concurrency: a release is not awaited, so the next admit may reach the
    # LaneAdmission replica before it.
    config = LanesConfig(interactive=LaneLimits(max_in_flight=4 * max(args.concurrency),
                                                max_queue=0))
    ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)
    try:
        probe = serve.deployment(Probe, name="AdmissionProbe", max_ongoing_requests=4,
                                 ray_actor_options={"num_cpus": 0})
        handle = serve.run(probe.bind(config, bind_admission(config, router_replicas=2)),
                           name="bench-admission", route_prefix=None)
        results: dict = {arm: {} for arm in ARMS}
        for concurrency in args.concurrency:
            for arm in ARMS:
                handle.run.remote(arm, args.warmup, concurrency).result()
                results[arm][f"c{concurrency}"] = handle.run.remote(
                    arm, args.requests, concurrency).result()
    finally:
        serve.shutdown()
        ray.shutdown()
    added = {level: round(results["application"][level]["admit_p50_us"]
                          - results["replica"][level]["admit_p50_us"], 1)
             for level in results["replica"]}
    report = {"benchmark": "admission", "arms": results, "added_admit_p50_us": added}
    Path(args.out).write_text(json.dumps(report, indent=2))
    for level, extra in added.items():
        app, own = results["application"][level], results["replica"][level]
        print(f"{level}: admit p50 {own['admit_p50_us']} us (replica) vs {app['admit_p50_us']} us "
              f"(application), +{extra} us; p99 {own['admit_p99_us']} vs {app['admit_p99_us']} us")
    print(f"results written to {args.out}")
    return 0
