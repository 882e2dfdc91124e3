"""Start a server as a child process, wait until it is healthy, stop it with SIGTERM.

Used by the test suite (the real `moonserve serve`) and by benchmarks (one server at a time).

Example:
    >>> with ServerProcess(["moonserve", "serve", "--port", "8011"],
    ...                    "http://127.0.0.1:8011/health", log_path=Path("serve.log")) as server:
    ...     ...   # server.pid, server.base_url
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil


# The line `moonserve serve` prints once its Ray cluster runs (pipeline/app/server.py).
RAY_ADDRESS_LINE = "moonserve: Ray cluster at "


class ServerFailed(RuntimeError):
    pass


def join_ray(address: str) -> None:
    """Join the Ray cluster at `address` (a `ServerProcess.ray_address()`) as a driver, once per
    process, sending the cluster's token as `ray.init(address="auto")` would. A cluster that
    `ray.init` starts runs with token authentication (~/.ray/auth_token) unless RAY_AUTH_MODE
    says otherwise; `ray.init` turns it on in the driver only for a cluster it found itself, and
    Ray reads RAY_AUTH_MODE once per process, at import, so setting it here would be too late."""
    import ray
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    if not ray.is_initialized():
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)


class ServerProcess:
    def __init__(self, cmd: list[str], health_url: str, log_path: Path, env: dict | None = None,
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 60.0):
        self.cmd = cmd
        self.health_url = health_url
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return self.health_url.rsplit("/", 1)[0]

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        began = time.monotonic()
        # Own session, so stop() can signal the server without touching the caller's group.
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        self.wait_healthy(began)
        self.startup_s = time.monotonic() - began
        return self

    def wait_healthy(self, began: float) -> None:
        while time.monotonic() - began < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.cmd[0]} exited with {self.proc.returncode} during start; "
                                   f"last log lines:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerFailed(f"not healthy after {self.start_timeout_s}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> int | None:
        """SIGTERM, wait; SIGKILL the whole tree if it does not exit in time. Returns the exit code
        (None when it had to be killed)."""
        return self._signal_and_wait(lambda proc: proc.send_signal(signal.SIGTERM))

    def _signal_and_wait(self, send) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        send(self.proc)
        try:
            return self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            for child in self.descendants():
                child.kill()
            self.proc.kill()
            self.proc.wait()
            return None

    def interrupt(self) -> int | None:
        """Ctrl-C as a terminal sends it: SIGINT to the server's whole process group (Ray's
        daemons and replicas included), then wait as `stop` does."""
        # Its own session: the group is the server's.
        return self._signal_and_wait(lambda proc: os.killpg(proc.pid, signal.SIGINT))

    def ray_address(self) -> str:
        """The GCS address of the Ray cluster this `moonserve serve` started or joined, from its
        log: what a driver passes to `join_ray`. `address="auto"` picks any cluster on the
        machine when more than one runs (a developer's own server, a test run beside a
        benchmark)."""
        found = re.search(re.escape(RAY_ADDRESS_LINE) + r"(\S+)",
                          self.log_path.read_text(errors="replace"))
        if found is None:
            raise ServerFailed(f"no {RAY_ADDRESS_LINE!r} line in {self.log_path}:\n{self.log_tail()}")
        return found.group(1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
