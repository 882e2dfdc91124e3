"""A two-node Ray cluster on this machine, started by the tests the way docs/clusters.md starts one.

`ray start --head` and `ray start --address` run with `--block`, so each node's processes (GCS,
raylet, dashboard, workers, vLLM engine cores) are the descendants of one process the test holds:
killing a node's raylet is killing a node, and stopping the cluster leaves nothing behind. Each
node gets its own ports (metrics export, dashboard agent, worker range) and custom resources that
pin deployments to it. Token authentication is on, as on any cluster Ray starts: every process
here gets the cluster's token in `RAY_AUTH_TOKEN`.

`prometheus` and `chromium` are Debian's packages (the README's setup installs them); the tests
that need one skip with the reason when it is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from tests.serving import is_alive

LOCALHOST = "127.0.0.1"
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class RayNode:
    """One `ray start ... --block` and every process it starts."""

    def __init__(self, name: str, args: list[str], env: dict, log_dir: Path):
        self.name = name
        self.args = args
        self.env = env
        self.log_path = log_dir / f"ray-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}

    def start(self) -> RayNode:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([RAY, "start", *self.args, "--block"], stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def descendants(self) -> list[psutil.Process]:
        """Every process of this node seen so far (workers re-parented on a raylet's death
        included), remembered so `stop` can end them."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        return list(self.seen.values())

    def raylet(self) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children():
            if p.name() == "raylet":
                return p
        raise AssertionError(f"{self.name}: no raylet among the node's processes")

    def kill_raylet(self) -> None:
        self.descendants()
        self.raylet().send_signal(signal.SIGKILL)

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc is None:
            return
        processes = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        left = [p for p in processes if is_alive(p)]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class TwoNodeCluster:
    """A head node and a worker node on 127.0.0.1. Resources: both `moonserve_lm: 1` (one
    LanguageModel replica each); `moonserve_head` / `moonserve_worker` to pin the others."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = Path(tempfile.mkdtemp(prefix="r2n", dir="/tmp"))  # short: socket paths
        self.token = secrets.token_hex(16)
        # Ray drains a node for up to 30 s when `ray start --block` gets SIGTERM (for a pod
        # deleted under live traffic); these nodes get it only once the app is gone, and the
        # head then sat out the whole 30 s at every run's end.
        # Serve's proxy (on the head) sends each request to a Router replica on its own node
        # when there is one; off, so a Router app with a replica on each node gets requests on
        # both (the stored-turns test).
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}
        self.env.pop("RAY_ADDRESS", None)
        (self.gcs_port, self.dashboard_port, self.client_port,
         *self.node_ports) = free_ports(3 + 2 * 4)
        self.head = RayNode("head", ["--head", "--port", str(self.gcs_port),
                                     "--dashboard-host", LOCALHOST,
                                     "--dashboard-port", str(self.dashboard_port),
                                     "--ray-client-server-port", str(self.client_port),
                                     "--temp-dir", str(self.temp_dir),
                                     *self.node_args(0, {"moonserve_lm": 1, "moonserve_draft": 1,
                                                        "moonserve_head": 1})],
                            self.env, root)
        self.worker = self.new_worker()

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOCALHOST}:{self.dashboard_port}"

    def node_args(self, k: int, resources: dict) -> list[str]:
        metrics, agent, agent_grpc, runtime_env = self.node_ports[4 * k:4 * k + 4]
        workers = 20000 + 2000 * k  # disjoint worker port ranges on the one IP
        return ["--num-cpus", "1",
                "--object-store-memory", str(300 * 1024 * 1024),
                "--resources", json.dumps(resources),
                "--metrics-export-port", str(metrics),
                "--dashboard-agent-listen-port", str(agent),
                "--dashboard-agent-grpc-port", str(agent_grpc),
                "--runtime-env-agent-port", str(runtime_env),
                "--min-worker-port", str(workers), "--max-worker-port", str(workers + 1999),
                "--disable-usage-stats"]

    def metrics_ports(self) -> list[int]:
        return [self.node_ports[0], self.node_ports[4]]

    def new_worker(self) -> RayNode:
        return RayNode("worker", ["--address", self.address,
                                  *self.node_args(1, {"moonserve_lm": 1, "moonserve_draft": 1})],
                       self.env, self.root)

    def start(self, timeout_s: float = 120) -> TwoNodeCluster:
        self.head.start()
        self.wait_for_nodes(1, timeout_s)
        self.worker.start()
        self.wait_for_nodes(2, timeout_s)
        return self

    def rejoin_worker(self, timeout_s: float = 120) -> None:
        """A new worker node with the old one's resources and ports (a rebooted machine)."""
        self.worker.stop()
        self.worker = self.new_worker().start()
        self.wait_for_nodes(2, timeout_s)

    def api(self, path: str, timeout_s: float = 10):
        request = urllib.request.Request(f"{self.dashboard_url}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read())

    def alive_nodes(self) -> list[dict]:
        nodes = self.api("/nodes?view=summary")["data"]["summary"]
        return [n for n in nodes if n["raylet"]["state"] == "ALIVE"]

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(urllib.error.URLError, OSError, KeyError, ValueError):
                if len(self.alive_nodes()) == n:
                    return
            for node in (self.head, self.worker):
                if node.proc is not None and node.proc.poll() is not None:
                    raise AssertionError(f"ray start exited:\n{node.log_tail()}")
            time.sleep(1)
        raise AssertionError(f"{n} alive node(s) not reached in {timeout_s} s:\n"
                             f"{self.head.log_tail()}")

    def serve_replicas(self, app: str) -> dict[str, list[dict]]:
        """Serve's view (the dashboard's REST API): deployment -> its replicas."""
        apps = self.api("/api/serve/applications/")["applications"]
        if app not in apps:
            return {}
        return {name: d.get("replicas", []) for name, d in apps[app]["deployments"].items()}

    def stop(self) -> None:
        for node in (self.worker, self.head):
            node.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class Prometheus:
    """Debian's Prometheus, scraping every node listed in Ray's service-discovery file (the
    dashboard keeps it current as nodes come and go), every 2 s."""

    def __init__(self, sd_file: Path, root: Path):
        self.port = free_ports(1)[0]
        self.root = root / "prometheus"
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
            "scrape_configs": [{"job_name": "ray", "file_sd_configs": [
                {"files": [str(sd_file)], "refresh_interval": "2s"}]}],
        }))
        self.log_path = self.root / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.root}/data",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def query(self, promql: str) -> list[dict]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               f"{urllib.parse.urlencode({'query': promql})}")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets",
                                    timeout=10) as r:
            return json.loads(r.read())["data"]["activeTargets"]

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return
            time.sleep(0.5)
        raise AssertionError("prometheus not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
