"""What every kernel's checks share: the error measure, GPU timing, the GPU-check entry point,
and running a test file's Triton cases in a `TRITON_INTERPRET=1` child process.

Example (a kernel's gpu_check.py):
    >>> sys.exit(gpu_check_main(__package__, lambda: [run_case(...) for ...]))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over all elements, in float32."""
    error = actual.float() - expected.float()
    return (error.pow(2).mean().sqrt() / expected.float().pow(2).mean().sqrt()).item()


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def gpu_check_main(package: str | None, run_cases: Callable[[], list[dict]]) -> int:
    """Run a kernel's GPU cases and print them as JSON: 0 all passed, 1 a case failed, 2 no GPU."""
    if not package:
        print("run as `python -m moonserve.kernels.<op>.gpu_check`", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA/ROCm device; this check needs a GPU"}))
        return 2
    cases = run_cases()
    passed = all(case["passed"] for case in cases)
    print(json.dumps({"device": torch.cuda.get_device_name(), "passed": passed, "cases": cases},
                     indent=2))
    return 0 if passed else 1


def run_interpreted(script: str, timeout_s: float = 300) -> dict:
    """Run `script` (a test file whose `__main__` prints its Triton results as one JSON line) in
    a child with TRITON_INTERPRET=1, where Triton kernels run on CPU; returns that JSON."""
    python_path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(python_path)}
    child = subprocess.run([sys.executable, script], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=timeout_s, check=False)
    if child.returncode != 0:
        raise AssertionError(f"TRITON_INTERPRET=1 child failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.splitlines()[-1])
