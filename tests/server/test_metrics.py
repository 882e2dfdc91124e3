"""The running app exports moonserve's metrics through Ray's Prometheus endpoint."""

from __future__ import annotations

import time

from moonserve.pipeline.metrics import METRICS
from tests.conftest import MODEL
from tests.payloads import data_url, image_chat, png
from tests.serving import scrape


# Counts faults: tests/server/test_faults.py checks it after killing the DraftService.
FAULT_METRICS = {"moonserve_draft_fallbacks"}
# Counts only once a request's drafts were rejected enough to pause it, which these requests do not
# promise; the proposer's count is checked in tests/unit/test_proposer_quiet.py.
PAUSE_METRICS = {"moonserve_draft_quiet_rows"}


def expected_samples() -> dict[str, str]:
    """Metric -> the Prometheus sample that must be non-zero after requests (gauges: present)."""
    names = {}
    for name, spec in METRICS.items():
        if name in FAULT_METRICS | PAUSE_METRICS:
            continue
        names[name] = {"counter": f"ray_{name}_total", "histogram": f"ray_{name}_count",
                       "gauge": f"ray_{name}"}[spec.kind]
    return names


def test_metrics_are_exported_with_values_after_requests(server, client):
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, stream=stream)
        if stream:
            list(r)
    # Answers that copy from the prompt: drafts proposed, accepted and prefetched.
    from moonserve.pipeline.bench.corpus import copy_prompts

    for prompt in copy_prompts(2):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=24, temperature=0)
    image = data_url(png((98, 70), (5, 6, 7)))
    for _ in range(2):  # a miss, then a hit
        client.chat.completions.create(model=MODEL, messages=image_chat(image), max_tokens=2)
    want = expected_samples()
    deadline, missing = time.monotonic() + 90, want
    while time.monotonic() < deadline:
        samples = scrape(server.metrics_url)
        missing = {m: s for m, s in want.items() if s not in samples or
                   (METRICS[m].kind != "gauge" and samples[s] <= 0)}
        if not missing:
            break
        time.sleep(3)
    assert not missing, f"not exported (or zero) after 90 s: {sorted(missing.values())}"
    assert samples["ray_moonserve_prompt_tokens_total"] > 0


def test_grafana_dashboard_queries_only_metrics_that_exist():
    import json
    import re

    from tests.conftest import REPO

    dashboard = json.loads((REPO / "configs" / "grafana" / "moonserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ray_(moonserve_[a-z_]+?)(?:_total|_bucket|_sum|_count)?\{", e)}
    assert used == set(METRICS), {"unknown": used - set(METRICS), "no panel": set(METRICS) - used}
