"""The session servers the live tests talk to: the real `moonserve serve` (Ray Serve + vLLM CPU
engine) on a config file, started once per test directory (a package-scoped fixture in its
conftest) and stopped as a user stops it.

- tests/smollm2: `configs/local.yaml` as shipped (SmolLM2-135M-Instruct), for the tests that need
  the model's real text.
- tests/server: the same file with only the model path changed (`tiny_model_config`): a 2-layer
  random-weight model with SmolLM2's tokenizer and chat template
  (`pipeline/prepare/tiny_model.py`), so lanes, priorities, drafts and images run as shipped at a
  tenth of the engine's cost; `RunningServer.paced` gives its steps a real model's pace where a
  test is about timing.

The teardown is a user's Ctrl-C (SIGINT to the whole process group) and fails the run if
`moonserve serve` does not exit cleanly, or if any of its processes (Ray's daemons, dashboard
modules, replicas, vLLM engine cores) is alive 30 s after.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import psutil
import uvicorn
import yaml

from moonserve.pipeline.app.launch import ServerProcess, join_ray
from moonserve.pipeline.config import DEFAULT_CONFIG, AppConfig


def local_args() -> tuple[dict, dict]:
    """The parsed `configs/local.yaml` and its application's `args` (edit these in place)."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return data, data["applications"][0]["args"]


def tiny_model_args() -> tuple[dict, dict]:
    """`configs/local.yaml` (parsed, and its application's `args`) with the tiny model as its LM,
    served under the embedded model's name (the embedded encoder and drafter are built for it:
    `prepare_vision_encoder`, `prepare_drafter`); nothing else changed."""
    from moonserve.pipeline.prepare.tiny_model import prepare_tiny_model

    data, args = local_args()
    engine = args["language_model"]["engine"]
    engine["served_model_name"] = AppConfig.model_validate(args).language_model.engine.model_name()
    engine["model"] = str(prepare_tiny_model())
    return data, args


def tiny_model_config(out: Path) -> Path:
    """`tiny_model_args()` written to `out`."""
    out.write_text(yaml.safe_dump(tiny_model_args()[0], sort_keys=False))
    return out


class RunningServer:
    def __init__(self, process: ServerProcess, config: Path, metrics_port: int):
        self.process = process
        self.config = config
        self.base_url = process.base_url
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.ray_address = process.ray_address()  # printed before the app answered /health

    def args(self) -> dict:
        """The application's `args` in this server's config file."""
        return yaml.safe_load(self.config.read_text())["applications"][0]["args"]

    def app_config(self, **router_args) -> AppConfig:
        """This server's application config with `router` args overridden."""
        args = self.args()
        args["router"].update(router_args)
        return AppConfig.model_validate(args)

    def lm_handle(self, app_name: str = "moonserve"):
        """A Ray Serve handle to the LanguageModel deployment (joins the server's Ray cluster)."""
        from ray import serve

        join_ray(self.ray_address)
        return serve.get_deployment_handle("LanguageModel", app_name=app_name)

    def lm_stats(self) -> dict:
        return self.lm_handle().stats.remote().result(timeout_s=60)

    def draft_handle(self):
        """A Ray Serve handle to the DraftService deployment (joins the server's Ray cluster)."""
        from ray import serve

        self.lm_handle()
        return serve.get_deployment_handle("DraftService", app_name="moonserve")

    def spec_counters(self) -> tuple[int, int]:
        """The engine's draft tokens and accepted draft tokens so far."""
        stats = self.lm_stats()
        return stats["num_draft_tokens"], stats["num_accepted_tokens"]

    @contextmanager
    def drafter(self, name: str, adaptive: bool | None = None, deadline_ms: float | None = None):
        """The DraftService drafts with `name` while the block runs (`none`: drafts nothing),
        then with the configured drafter again. Yields the DraftService's handle."""
        handle = self.draft_handle()
        handle.set_drafter.remote(name, adaptive).result(timeout_s=60)
        handle.set_deadline.remote(deadline_ms).result(timeout_s=60)
        try:
            yield handle
        finally:
            handle.set_drafter.remote(self.args()["draft"]["drafter"]).result(timeout_s=60)
            handle.set_deadline.remote(None).result(timeout_s=60)

    @contextmanager
    def paced(self, step_s: float):
        """Every engine step lasts at least `step_s` seconds while the block runs (the vLLM
        plugin's step pace): the tiny model streams at a real model's rate, the core stays free."""
        lm = self.lm_handle()
        lm.collective_rpc.remote("set_step_pace", step_s).result(timeout_s=60)
        try:
            yield
        finally:
            lm.collective_rpc.remote("set_step_pace", 0.0).result(timeout_s=60)

    @contextmanager
    def router_app(self, name: str, **router_args):
        """A second Router app at `/<name>` with `router` args overridden, bound to this server's
        LanguageModel (no second engine). Yields its base URL."""
        from ray import serve

        self.deploy_router(name, **router_args)
        try:
            yield f"{self.base_url}/{name}"
        finally:
            serve.delete(name)

    @contextmanager
    def router_here(self, **router_args):
        """The Router with `router` args overridden, in this process (uvicorn on a free port of
        127.0.0.1, on a thread and event loop of its own), bound to this server's LanguageModel
        through its Serve handle: a test of a Router-only setting, with no replica to start and
        no Serve proxy between client and Router. A rate limit gets its RateLimiter deployed
        on the server's cluster. Yields its base URL."""
        from ray import serve

        from moonserve.deployments.builder import (bind_rate_limiter, resolve_api_keys,
                                                   resolve_model_path)
        from moonserve.deployments.router import Router

        config = self.app_config(**router_args)
        lm_handle = self.lm_handle()
        limiter = bind_rate_limiter(config.router.rate_limits)
        if limiter is not None:
            limiter = serve.run(limiter, name="router-here-limits", route_prefix=None)
        served = AsyncExitStack()

        async def start() -> str:
            router = Router(config.router, lm_handle, resolve_model_path(config.language_model),
                            api_keys=resolve_api_keys(config.router),
                            chat=config.language_model.chat, rate_limiter=limiter)
            return await served.enter_async_context(listening(router.__serve_build_asgi_app__()))

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="router-here", daemon=True)
        thread.start()
        try:
            url = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=120)
            try:
                yield url
            finally:
                asyncio.run_coroutine_threadsafe(served.aclose(), loop).result(timeout=60)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()
            if limiter is not None:
                serve.delete("router-here-limits")

    def deploy_router(self, name: str, **router_args) -> None:
        """Deploy (or redeploy) the Router app `name` as `router_app` does; returns once it runs."""
        from ray import serve

        from moonserve.deployments.builder import bind_router, resolve_model_path

        config = self.app_config(**router_args)
        lm_handle = self.lm_handle()
        app = bind_router(config.router, lm_handle, resolve_model_path(config.language_model),
                          chat=config.language_model.chat, drain_s=config.drain_s())
        serve.run(app, name=name, route_prefix=f"/{name}")


@asynccontextmanager
async def listening(app) -> AsyncIterator[str]:
    """`app` (ASGI) served by uvicorn on a free port of 127.0.0.1, on this event loop; yields its
    base URL, and stops it after."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why uvicorn did not start
            raise AssertionError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def session_server(root: Path, config: Path, port: int):
    """Generator for a fixture: `moonserve serve --config config` on `port` (dashboard on
    port + 150, Ray's metrics on port + 160), logging under `root`; yields a `RunningServer`,
    then stops it with Ctrl-C and checks that nothing of it is left."""
    process = ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config),
         "--port", str(port), "--dashboard-port", str(port + 150),
         "--metrics-export-port", str(port + 160)],
        f"http://127.0.0.1:{port}/health", log_path=root / "moonserve-serve.log",
        start_timeout_s=420,
    )
    process.start()
    tree = process.descendants()
    yield RunningServer(process, config, port + 160)
    disconnect_ray()
    tree = list({p.pid: p for p in tree + process.descendants()}.values())  # and what started since
    began = time.monotonic()
    code = process.interrupt()  # Ctrl-C in a terminal: SIGINT to every process of the group
    assert code == 0, f"moonserve serve exited with {code} after Ctrl-C:\n{process.log_tail()}"
    left = wait_gone(tree, timeout_s=max(1.0, 30 - (time.monotonic() - began)))
    assert not left, f"processes left 30 s after Ctrl-C: {left}"


def scrape(url: str) -> dict[str, float]:
    """Prometheus text at `url` -> {sample name: sum of its values over all label sets}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def settled(url: str, sample: str, period_s: float = 3.0, timeout_s: float = 30.0) -> float:
    """`sample`'s value at `url` once two reads `period_s` apart agree (Ray exports metrics every
    few seconds), or the last read after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    value = scrape(url).get(sample, 0.0)
    while time.monotonic() < deadline:
        time.sleep(period_s)
        value, last = scrape(url).get(sample, 0.0), value
        if value == last:
            break
    return value


def disconnect_ray() -> None:
    """Leave the server's cluster, and forget Serve's client for it: a process that joins the
    next session server's cluster would else reuse it (Serve keeps a client while the driver's
    job id is the same, and a second cluster gives this process the same job id), and with it
    handles to the last cluster's replicas."""
    import ray
    from ray.serve import context

    if ray.is_initialized():
        ray.shutdown()
    context._set_global_client(None)


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {p.name()}" for p in alive]
        time.sleep(0.5)


def is_alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
