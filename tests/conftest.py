"""What every test directory shares: paths, the model name, and the markers applied at collection.

- `server`: every test that uses the `server` fixture (the session servers of tests/server, on
  the tiny model, and tests/smollm2, on SmolLM2: tests/serving.py), directly or through other
  fixtures, needs the live app, and so does every test in tests/cluster (its own two-node
  cluster) and tests/engines (apps and engines of their own, one at a time); `pytest -m "not
  server"` runs everything else.
- pytest-xdist: the suite runs on two workers (pyproject's addopts, `-n 2`; `-n 0` runs it in
  this process). Each directory that holds engines is one group and each other module one
  group; a group's tests run in order on one worker, so its fixtures start once (a session
  server is package-scoped: it stops when its directory's tests are done). The groups with
  engines go out first (ENGINE_GROUPS). The engines a worker starts bind to its own core,
  so the two workers' engines never share one (`share_cores`).
  Drivers join their own app's Ray cluster by address (`join_ray(process.ray_address())`),
  never "auto", which takes any cluster on the machine.
- `gpu`: skipped when there is no CUDA/ROCm device.
- `destructive`: kills parts of its directory's session server, so these run last in it.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest

from moonserve.pipeline.config import DEFAULT_CONFIG

REPO = Path(__file__).resolve().parent.parent


def vllm_config_parts(engine_args) -> dict:
    """The sub-configs vLLM's `create_engine_config` builds from `engine_args` (AsyncEngineArgs)
    and hands to `VllmConfig`, captured there: the CPU build's VllmConfig refuses DSpark
    ("Model Runner V1 does not support"), so tests of GPU configs read what vLLM resolved
    before it (tests/unit/test_production_config.py, test_recipe_profile.py)."""
    import copy

    from vllm.engine import arg_utils

    captured = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(arg_utils, "VllmConfig", lambda **kwargs: captured.update(kwargs))
        copy.deepcopy(engine_args).create_engine_config()
    return captured


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`moonserve ARGS` in this process (the CLI's `main`, which its console script calls; a
    subprocess costs ~2 s of imports per call): exit status and captured output.
    tests/unit/test_cli.py runs the real entry point in subprocesses."""
    from moonserve.pipeline.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["moonserve", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def claude(server):
    """The `anthropic` client on the directory's session server."""
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis server (Debian's `redis-server`, README setup) on a free port, for the
    stored Responses of `router.responses.database: redis://...`; skipped without the package."""
    import shutil
    import socket
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs Debian's redis-server package (README setup)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(root)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert server.poll() is None and time.monotonic() < deadline, \
                "redis-server did not start"
            time.sleep(0.1)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


LOCAL_CONFIG = DEFAULT_CONFIG
MODEL = "moonserve-embedded"  # the served model name in LOCAL_CONFIG
OWN_APP_TESTS = (REPO / "tests" / "cluster", REPO / "tests" / "engines")


# pytest-xdist's groups: a group's tests run in order on one worker, so its fixtures start once.
# One per directory that holds engines (its session or module apps start once, and one worker's
# tests never see another's engines), in the order they go out: the two longest first, one on
# each worker, the two-node cluster in a fresh worker (two runs that sent it out after
# tests/smollm2, in the worker that had served it, lost every gauge of its app from Prometheus;
# cause not found); else one per module.
ENGINE_GROUPS = {"tests/cluster/": "cluster", "tests/server/": "session-server",
                 "tests/smollm2/": "smollm2", "tests/engines/": "engines"}


def xdist_group(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return next((g for prefix, g in ENGINE_GROUPS.items() if module.startswith(prefix)), module)


def pytest_xdist_make_scheduler(config, log):
    """`xdist_group`'s groups as xdist's scopes. xdist's own `--dist loadgroup` would do it from
    `xdist_group` marks, but it passes them on by rewriting node ids, which pytest 9.2 no longer
    reads (pytest-xdist#1386: every test then goes out on its own, silently)."""
    from xdist.scheduler import LoadScopeScheduling

    # Groups in collection order (pytest_collection_modifyitems puts the engines' first).
    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        share_cores(int(config.workerinput["workerid"].removeprefix("gw")),
                    int(config.workerinput["workercount"]))


def share_cores(index: int, workers: int) -> None:
    """The vLLM engines this worker starts bind their OpenMP threads to the worker's share of the
    cores (the servers it starts inherit VLLM_CPU_OMP_THREADS_BIND; with vLLM's `auto` every
    engine takes the first core, so two workers' engines would share it); torch's threads here:
    as many. Every other process runs where the OS puts it, so a worker waiting on a paced
    stream leaves both cores to the other."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    share = cores[index % len(cores)::workers] or cores
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
    torch.set_num_threads(len(share))


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if "server" in getattr(item, "fixturenames", ()) or \
                any(d in item.path.parents for d in OWN_APP_TESTS):
            item.add_marker(pytest.mark.server)
    skip_gpu_tests_without_a_device(items)
    items.sort(key=run_order)


def run_order(item) -> tuple[int, bool]:
    """The groups with engines first, in ENGINE_GROUPS' order, then the rest as collected; a
    group's destructive tests last in it (sort is stable)."""
    group = xdist_group(item.nodeid)
    rank = list(ENGINE_GROUPS.values()).index(group) if group in ENGINE_GROUPS.values() \
        else len(ENGINE_GROUPS)
    return rank, item.get_closest_marker("destructive") is not None


def skip_gpu_tests_without_a_device(items) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA/ROCm device"))
