"""A module's own moonserve app and Serve handle calls made from a child process, for the tests in
tests/engines (each runs its own app, which a session server of tests/server or tests/smollm2
may run beside, in another pytest-xdist worker).

- `running_app(root, data, port)`: `moonserve serve` on the config `data` (`configs/local.yaml`
  as `tests.serving.local_args()` reads it, edited), on `port` (dashboard and metrics ports
  derived), logging to `root/serve.log`; yields the `ServerProcess` and stops it after.
- `serve_calls_in_child(address)`: yields `call(deployment, method, *args)`, a Serve handle call
  made in a spawned child process, joined to the Ray cluster at `address` (the app's
  `ray_address()`: another cluster may run on the machine, e.g. the session server's in the
  other pytest-xdist worker), that goes with the context. A handle in the test process would
  keep Serve's client state for this app's cluster, and the session server's handles in later
  tests would then wait on replicas that are gone. `call.pool` runs other functions in that
  child; they call `join_ray(call.address)` first.
"""

from __future__ import annotations

import multiprocessing
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml

from moonserve.pipeline.app.launch import ServerProcess, join_ray


@contextmanager
def running_app(root: Path, data: dict, port: int, env: dict | None = None):
    config = root / "app.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    process = ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config),
         "--port", str(port), "--dashboard-port", str(port + 150),
         "--metrics-export-port", str(port + 160)],
        f"http://127.0.0.1:{port}/health", log_path=root / "serve.log", env=env,
        start_timeout_s=420)
    process.start()
    try:
        yield process
    finally:
        assert process.interrupt() == 0, process.log_tail()


def call_deployment(address: str, deployment: str, method: str, args: tuple):
    """A Serve handle call, in the child process."""
    from ray import serve

    join_ray(address)
    handle = serve.get_deployment_handle(deployment, app_name="moonserve")
    return getattr(handle, method).remote(*args).result(timeout_s=120)


@contextmanager
def serve_calls_in_child(address: str):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        def call(deployment: str, method: str, *args):
            return pool.apply(call_deployment, (address, deployment, method, args))

        call.pool, call.address = pool, address
        yield call
        pool.terminate()
