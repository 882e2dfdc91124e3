"""`moonserve bench sampling` (pipeline/bench/sampling.py): vLLM's plain sampler against its
rejection sampler on a step without drafts, the premise of the ServiceProposer's plain path."""

from __future__ import annotations

import json
import subprocess
import sys

from moonserve.pipeline.bench import sampling


def test_both_arms_run_and_greedy_steps_sample_the_same_tokens(tmp_path):
    """In a fresh interpreter: the bench registers the CPU build's Triton kernel overrides, which
    rebinds kernels across every loaded module (not something to do inside a test session)."""
    out = tmp_path / "sampling.json"
    subprocess.run([sys.executable, "-m", "moonserve.pipeline.app.cli", "bench", "sampling",
                    "--vocab", "4096", "--batch-sizes", "1", "5", "--calls", "2", "--out",
                    str(out)], capture_output=True, text=True, timeout=300, check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_size"], r["sampling"]) for r in rows] == [
        (1, "greedy"), (1, "random"), (5, "greedy"), (5, "random")]
    for row in rows:
        assert row["plain_ms"] > 0 and row["rejection_no_drafts_ms"] > 0
    # Without drafts the rejection sampler's one token per request is the plain sampler's.
    assert all(r["same_tokens"] for r in rows if r["sampling"] == "greedy")


def test_the_no_draft_metadata_is_what_the_runner_builds():
    """One sampled token per request, each request's own logits row as its bonus row (the dummy
    metadata vLLM makes for warm-ups points every row at row 0)."""
    spec = sampling.no_drafts(3)
    assert spec.max_spec_len == 0 and spec.num_draft_tokens == [0, 0, 0]
    assert spec.bonus_logits_indices.tolist() == [0, 1, 2]
    assert spec.cu_num_sampled_tokens.tolist() == [1, 2, 3]
