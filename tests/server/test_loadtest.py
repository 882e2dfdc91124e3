"""A short, bounded Locust run against the running app: exit code, and TTFT/ITL entries per lane."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

LOCUST = Path(sys.executable).with_name("locust")
LOCUSTFILE = "loadtest/locustfile.py"


def locust(server, out: Path, run_s: int, users: int, classes: list[str], *extra: str,
           files: str = LOCUSTFILE):
    cmd = [str(LOCUST), "-f", files, "--headless",
           "-u", str(users), "-r", str(users), "-t", f"{run_s}s", "--stop-timeout", "120",
           "--host", server.base_url, "--json-file", str(out / "run"),
           "--html", str(out / "report.html"), "--only-summary", *extra, *classes]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=run_s + 180, cwd=REPO)


def stats_rows(out: Path) -> dict[tuple[str, str], dict]:
    """The run's final stats. Locust writes --json-file once every user has stopped; its CSV is
    rewritten every second or two and can miss a request that ends in the run's last moment."""
    rows = json.loads((out / "run.json").read_text())
    return {(row["method"], row["name"]): row for row in rows}


def test_bounded_locust_run_passes_and_reports_ttft_per_lane(server, tmp_path):
    # Long prompts of ~1,200 tokens (over the 1,024-token lane threshold) finish before Locust
    # exits: --stop-timeout lets a user finish the stream it is reading.
    run = locust(server, tmp_path, 25, 4, ["InteractiveChat", "MultimodalChat", "LongContextUser"],
                 "--long-context-users", "1", "--long-context-fraction", "0.3",
                 "--max-error-ratio", "0",
                 "--max-ttft-p99-ms", "60000")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = stats_rows(tmp_path)
    for key in [("TTFT", "interactive"), ("ITL", "interactive"), ("TTFT", "long_context"),
                ("POST", "chat [interactive]"), ("POST", "chat+image [interactive]"),
                ("POST", "chat [long_context]")]:
        assert key in rows, f"{key} missing from {sorted(rows)}\n{run.stderr[-3000:]}"
        assert rows[key]["num_requests"] > 0
        assert rows[key]["num_failures"] == 0
    assert (tmp_path / "report.html").stat().st_size > 0


def test_a_broken_threshold_sets_the_exit_code(server, tmp_path):
    run = locust(server, tmp_path, 6, 1, ["InteractiveChat"], "--max-ttft-p99-ms", "0.001")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "threshold failed: TTFT p99 interactive" in run.stdout + run.stderr


def test_load_shape_drives_the_run_and_ends_it(server, tmp_path):
    """The spike shape (loadtest/shapes.py) sets the users and stops the run after
    --shape-seconds, well before -t."""
    began = time.monotonic()
    run = locust(server, tmp_path, 120, 2, ["InteractiveChat"], "--load-shape", "spike",
                 "--shape-seconds", "8", files=f"{LOCUSTFILE},loadtest/shapes.py")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert time.monotonic() - began < 90, "the shape did not end the run (-t is 120 s)"
    assert stats_rows(tmp_path)[("TTFT", "interactive")]["num_requests"] > 0
