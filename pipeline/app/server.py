"""`moonserve serve`: start (or join) Ray, deploy the config's applications, stop cleanly on a signal.

The config file is the same Ray Serve config file `serve run` takes. Its applications' `args` are
validated before Ray starts, so a typo fails in a second, not after an engine start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from moonserve.pipeline.app.launch import RAY_ADDRESS_LINE
from moonserve.pipeline.config import EMBEDDED_MODEL, AppConfig, load_serve_config

# What ray.shutdown left of the local cluster gets this long after SIGTERM, then SIGKILL.
STOP_GRACE_S = 10.0

# Ray Serve's timers for the local cluster `moonserve serve` starts (a variable already in the
# environment wins; a joined cluster has what its `ray start` had). With Serve's defaults they
# take CPU from the engine on a small machine (`moonserve bench overhead`: the
# `pipeline_serve_defaults` arm has Ray's defaults):
# - the controller's loop every 0.5 s instead of 0.1 s (its reaction to a dead replica or a new
#   deployment; health checks stay every 10 s);
# - replicas and handles export Serve's request metrics every 1 s instead of 0.1 s (Prometheus
#   scrapes every few seconds).
# Serve's threads stay as they are: with each replica's code and its handles' router on the
# replica's own loop (`pipeline_one_loop`), one stream's TTFT and inter-token latency measured
# worse in every round, for no clear CPU saving at 16 streams (docs/benchmarks.md). The app
# works either way (the draft resolver calls its handle on the replica's loop).
SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


@dataclass(frozen=True)
class ServeOptions:
    config: Path
    address: str | None = None
    host: str | None = None
    port: int | None = None
    dashboard_port: int = 8265
    # Port of the local Ray node's Prometheus endpoint (None: Ray picks a free one).
    metrics_export_port: int | None = None


@dataclass(frozen=True)
class AppSpec:
    name: str
    route_prefix: str
    config: AppConfig
    # Ray Serve's field: replicas set from outside (the dashboard's `.../scale` REST call), each
    # deployment scaled in place without replacing the others; no `autoscaling` in the app.
    external_scaler_enabled: bool = False


def read_apps(path: Path) -> tuple[dict, list[AppSpec]]:
    """The config's Serve-wide options (`http_options`, `proxy_location`) and its validated
    applications."""
    data = load_serve_config(path)
    apps = []
    for i, app in enumerate(data["applications"]):
        if app.get("deployments"):
            raise ValueError(
                f"{path}: applications[{i}].deployments: moonserve takes deployment options from "
                "`args` (router.deployment, language_model.deployment); remove this block"
            )
        config = AppConfig.model_validate(app.get("args") or {})
        external = bool(app.get("external_scaler_enabled", False))
        if external and (scaled := config.autoscaled()):
            raise ValueError(
                f"{path}: applications[{i}].external_scaler_enabled: Serve's autoscaling cannot "
                f"run beside an external scaler; set num_replicas instead of {', '.join(scaled)}")
        apps.append(AppSpec(app.get("name", "default"), app.get("route_prefix", "/"), config,
                            external))
    serve_wide = {"http_options": data.get("http_options") or {},
                  "proxy_location": data.get("proxy_location")}
    ingress(apps)
    return serve_wide, apps


def ingress(apps: list[AppSpec]) -> str:
    """The cluster's `router.ingress`, which every application must share (it is Serve's mode)."""
    modes = {app.name: app.config.router.ingress for app in apps}
    if len(set(modes.values())) > 1:
        raise ValueError(f"router.ingress differs between applications ({modes}): it is the "
                         "whole cluster's way in; give every application the same")
    return next(iter(modes.values()))


def cluster_env(apps: list[AppSpec]) -> dict[str, str]:
    """Environment for the local cluster `moonserve serve` starts: SERVE_ENV where the
    environment does not already say, and Serve's HAProxy mode for `router.ingress: haproxy`."""
    env = {name: os.environ.get(name, value) for name, value in SERVE_ENV.items()}
    if ingress(apps) == "haproxy":
        env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    return env


def start_ray(options: ServeOptions, apps: list[AppSpec]) -> None:
    import ray

    if options.address:
        if ingress(apps) == "haproxy":
            # Serve reads it in each node's processes, which `ray start` started.
            print("moonserve: router.ingress is haproxy: every node of the cluster must have been "
                  "started with RAY_SERVE_ENABLE_HA_PROXY=1 (else Serve's proxy serves)", flush=True)
        ray.init(address=options.address)
        return
    become_subreaper()
    os.environ.update(cluster_env(apps))  # the cluster's processes inherit the driver's env
    ray.init(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=options.dashboard_port,
             _metrics_export_port=options.metrics_export_port)


def dashboard_login(environ=os.environ) -> str:
    """How into the dashboard: with Ray's token authentication on (the default for a cluster
    `ray.init` starts; `RAY_AUTH_MODE=disabled` turns it off), it asks for the cluster's token."""
    if environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ""
    return " (it asks for Ray's token: `ray get-auth-token` prints it)"


def metrics_url() -> str | None:
    """The Prometheus endpoint of this driver's Ray node (moonserve's and Ray's own metrics)."""
    import ray

    node = next((n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")), None)
    return None if node is None else \
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def prepare_embedded(apps: list[AppSpec]) -> None:
    """Build the embedded checkpoint before Ray starts, so its progress bar is readable."""
    if any(a.config.language_model.engine.model == EMBEDDED_MODEL for a in apps):
        from moonserve.pipeline.prepare.language_model import prepare_language_model
        from moonserve.pipeline.prepare.vision_encoder import prepare_vision_encoder

        lm_path = prepare_language_model()
        if any(a.config.vision and a.config.vision.encoder.model == EMBEDDED_MODEL for a in apps):
            prepare_vision_encoder(lm_path)


def deploy(options: ServeOptions, serve_wide: dict, apps: list[AppSpec]) -> tuple[str, int]:
    """Start Serve as the config says (`proxy_location` too: `HeadOnly` keeps one proxy, on the
    head node) and run each application."""
    from ray import serve

    from moonserve.deployments.builder import build_app

    http = serve_wide["http_options"]
    host = options.host or http.get("host", "127.0.0.1")
    port = options.port or int(http.get("port", 8000))
    serve.start(http_options={"host": host, "port": port},
                proxy_location=serve_wide["proxy_location"])
    for app in apps:
        serve.run(build_app(app.config), name=app.name, route_prefix=app.route_prefix,
                  external_scaler_enabled=app.external_scaler_enabled)
    return host, port


class ShutdownRequested(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def shutdown_handler():
    """A handler that turns the first SIGINT/SIGTERM into `ShutdownRequested`, so start-up or
    serving unwinds into the cleanup in `run_until_signalled`; later signals are ignored."""
    requested: list[int] = []

    def handler(signum, frame):
        if requested:
            return
        requested.append(signum)
        raise ShutdownRequested(signum)

    return handler


def listen(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def run_until_signalled(options: ServeOptions) -> int:
    """Deploy, serve until Ctrl-C/SIGTERM, then stop what was started. Config errors are raised
    before Ray starts."""
    import ray

    serve_wide, apps = read_apps(options.config)
    handler = shutdown_handler()
    listen(handler)
    try:
        prepare_embedded(apps)
        start_ray(options, apps)
        listen(handler)  # ray.init installs its own SIGTERM handler (it aborts the driver)
        # Before the API answers: a driver that waits for /health finds the address here.
        print(f"{RAY_ADDRESS_LINE}{ray.get_runtime_context().gcs_address}", flush=True)
        host, port = deploy(options, serve_wide, apps)
        via = "Serve's HAProxy" if ingress(apps) == "haproxy" else "Serve's proxy"
        print(f"moonserve: OpenAI API at http://{host}:{port}/v1 (health: /health; through {via})",
              flush=True)
        if not options.address:
            print(f"moonserve: Ray dashboard at http://127.0.0.1:{options.dashboard_port}"
                  f"{dashboard_login()}", flush=True)
        print(f"moonserve: Prometheus metrics at {metrics_url()}", flush=True)
        while True:
            signal.pause()
    except ShutdownRequested as request:
        print(f"moonserve: {request} received, shutting down", flush=True)
    finally:
        if ray.is_initialized():
            stop(options, apps)
    return 0


def stop(options: ServeOptions, apps: list[AppSpec]) -> None:
    """Local cluster: stop Serve and Ray. Shared cluster: remove only this config's apps."""
    import ray
    from ray import serve

    if options.address:
        for app in apps:
            serve.delete(app.name)
        return
    serve.shutdown()
    ray.shutdown()
    end_descendants(STOP_GRACE_S)


def become_subreaper() -> None:
    """Linux: descendants orphaned on the way down (a dashboard module after its head died of
    Ctrl-C, which reaches the whole process group) are re-parented to this process instead of
    init, so `end_descendants` still finds them."""
    if sys.platform == "linux":
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants(grace_s: float) -> None:
    """SIGTERM whatever of the local cluster `ray.shutdown` left, SIGKILL it after `grace_s`."""
    left = psutil.Process().children(recursive=True)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
