"""A short, bounded Locust run against the running app: exit code, and TTFT/ITL entries per lane."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).with_name("locust")



def locust(server, out: Path, run_s: int, users: int, classes: list[str], *extra: str):
    cmd = [str(LOCUST), "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
           "-u", str(users), "-r", str(users), "-t", f"{run_s}s", "--stop-timeout", "60",
           "--host", server.base_url, "--csv", str(out / "run"), "--html", str(out / "report.html"),
           "--only-summary", *extra, *classes]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=run_s + 120, cwd=REPO)


def stats_rows(out: Path) -> dict[tuple[str, str], dict]:
    with (out / "run_stats.csv").open() as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def test_bounded_locust_run_passes_and_reports_ttft_per_lane(server, tmp_path):
    # Long prompts of ~1,200 tokens (over the 1,024-token lane threshold) finish inside the run.
    run = locust(server, tmp_path, 25, 4, ["InteractiveChat", "MultimodalChat", "LongContextUser"],
                 "--long-context-users", "1", "--long-context-fraction", "0.3",
                 "--max-error-ratio", "0",
                 "--max-ttft-p99-ms", "60000")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = stats_rows(tmp_path)
    for key in [("TTFT", "interactive"), ("ITL", "interactive"), ("TTFT", "long_context"),
                ("POST", "chat [interactive]"), ("POST", "chat+image [interactive]"),
                ("POST", "chat [long_context]")]:
        assert key in rows, f"{key} missing from {sorted(rows)}"
        assert int(rows[key]["Request Count"]) > 0
        assert int(rows[key]["Failure Count"]) == 0
    assert (tmp_path / "report.html").stat().st_size > 0


def test_a_broken_threshold_sets_the_exit_code(server, tmp_path):
    run = locust(server, tmp_path, 6, 1, ["InteractiveChat"], "--max-ttft-p99-ms", "0.001")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "threshold failed: TTFT p99 interactive" in run.stdout + run.stderr
