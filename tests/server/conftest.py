"""The real `moonserve serve` (Ray Serve + vLLM CPU engine), started once per run.

Tests here talk to it over real HTTP with the real `openai` client; tests/conftest.py marks every
test that uses the `server` fixture `server`. The fixture's teardown is a user's Ctrl-C (SIGINT to
the whole process group) and fails the run if `moonserve serve` does not exit cleanly, or if any of
its processes (Ray's daemons, dashboard modules, replicas, vLLM engine cores) is alive 30 s after.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import openai
import psutil
import pytest
import yaml

from moonserve.pipeline.app.launch import ServerProcess, join_ray
from moonserve.pipeline.config import DEFAULT_CONFIG as LOCAL_CONFIG

# Ports away from the defaults, so a developer's own `moonserve serve` does not collide.
HTTP_PORT = int(os.environ.get("MOONSERVE_TEST_PORT", "8123"))
DASHBOARD_PORT = HTTP_PORT + 150
METRICS_PORT = HTTP_PORT + 160


class RunningServer:
    def __init__(self, process: ServerProcess):
        self.process = process
        self.base_url = process.base_url
        self.ray_address = process.ray_address()  # printed before the app answered /health

    def lm_handle(self, app_name: str = "moonserve"):
        """A Ray Serve handle to the LanguageModel deployment (joins the server's Ray cluster)."""
        from ray import serve

        join_ray(self.ray_address)
        return serve.get_deployment_handle("LanguageModel", app_name=app_name)

    def lm_stats(self) -> dict:
        return self.lm_handle().stats.remote().result(timeout_s=60)

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

    def deploy_router(self, name: str, **router_args) -> None:
        """Deploy (or redeploy) the Router app `name` as `router_app` does; returns once it runs."""
        from ray import serve

        from moonserve.deployments.builder import bind_router, resolve_model_path
        from moonserve.pipeline.config import AppConfig

        args = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]
        args["router"].update(router_args)
        config = AppConfig.model_validate(args)
        lm_handle = self.lm_handle()
        app = bind_router(config.router, lm_handle, resolve_model_path(config.language_model),
                          chat=config.language_model.chat, drain_s=config.drain_s())
        serve.run(app, name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RunningServer:
    log = tmp_path_factory.mktemp("server") / "moonserve-serve.log"
    process = ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(LOCAL_CONFIG),
         "--port", str(HTTP_PORT), "--dashboard-port", str(DASHBOARD_PORT),
         "--metrics-export-port", str(METRICS_PORT)],
        f"http://127.0.0.1:{HTTP_PORT}/health", log_path=log, start_timeout_s=420,
    )
    process.start()
    tree = process.descendants()
    yield RunningServer(process)
    disconnect_ray()
    tree = list({p.pid: p for p in tree + process.descendants()}.values())  # and what started since
    began = time.monotonic()
    code = process.interrupt()  # Ctrl-C in a terminal: SIGINT to every process of the group
    assert code == 0, f"moonserve serve exited with {code} after Ctrl-C:\n{process.log_tail()}"
    left = wait_gone(tree, timeout_s=max(1.0, 30 - (time.monotonic() - began)))
    assert not left, f"processes left 30 s after Ctrl-C: {left}"


def disconnect_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


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


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def reference_model():
    """transformers' model and tokenizer on the same checkpoint, float32, for equivalence tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    path = prepare_language_model(progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))
