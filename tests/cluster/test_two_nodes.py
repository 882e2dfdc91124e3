"""The app on a two-node Ray cluster: one LanguageModel replica per node, a node lost and regained.

A head and a worker node on this machine (tests/cluster/conftest.py), each with `moonserve_lm: 1`
and `moonserve_draft: 1`, so each node runs one LanguageModel replica (the tiny model of
tests/serving.py, its steps paced) and one of the two DraftService shards (speculation: requests
sharded by id); the Router and Serve's one proxy on the head. The app is deployed by `moonserve
serve --address` as a user deploys onto a cluster, with `external_scaler_enabled` (replicas set
from outside). A real Prometheus scrapes every node through Ray's service-discovery file.

Prefix-affinity routing keeps each conversation on one node's replica: its first turn goes where
power of two choices sends it, every later turn to the replica holding its prefix; the
same for a Responses session continued by `previous_response_id`.

Under load, the worker node's raylet is SIGKILLed: every request is counted (completed, or failed
with an error the client sees), its streams end with an error event and `[DONE]`, new requests
go to the head's replica; the node rejoins and the app serves on both replicas again. Then every
Grafana panel's query has a series in that Prometheus, and headless Chromium logs into the Ray
dashboard with the cluster's token (as the README says) and takes the screenshot in the docs.
Then a second Router app with a replica on each node keeps Responses turns in a real Redis
(Debian's `redis-server`), and each replica reads what the other stored. Last, Ray's own scale
call (the dashboard's REST API) takes the LanguageModel from two replicas to one under load and
cuts no stream.

These tests run in order and share one cluster, on one pytest-xdist worker (the other runs a
session server's tests beside them: tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
import yaml

from moonserve.pipeline.app.launch import ServerProcess
from moonserve.pipeline.bench.corpus import copy_prompts, filler_text
from moonserve.pipeline.bench.routing import replica_stats
from tests.cluster.conftest import Prometheus, TwoNodeCluster, free_ports
from tests.conftest import MODEL, REPO
from tests.serving import tiny_model_args

pytestmark = pytest.mark.timeout(900)

APP = "moonserve"
DEPLOYMENTS = ("Router", "LanguageModel", "DraftService", "VisionEncoder", "ImagePreprocessor")
# docs/images/: `MOONSERVE_UPDATE_DOCS=1 python -m pytest tests/cluster -k dashboard` remakes them.
DOCS_SCREENSHOTS = ("ray-dashboard-serve-app.png", "ray-dashboard-nodes.png")


# Each engine step paced at 50 ms (the tiny model's own are a few ms): streams last as long as
# the kill and scale-down tests need them to.
STEP_S = 0.05


def two_node_config(http_port: int) -> dict:
    """configs/local.yaml on the tiny model (tests/serving.py) with two LanguageModel replicas,
    one per `moonserve_lm` node, scaled from outside (`external_scaler_enabled`)."""
    data, _ = tiny_model_args()
    data["http_options"]["port"] = http_port
    # Replicas set from outside (the scale-down test's REST call): no Serve autoscaling beside it.
    data["applications"][0]["external_scaler_enabled"] = True
    args = data["applications"][0]["args"]
    args["vision"]["preprocessor"]["deployment"] = {"num_replicas": 1, "max_ongoing_requests": 32}
    args["router"]["deployment"]["resources"] = {"moonserve_head": 0.01}
    lm = args["language_model"]
    lm["deployment"] = {"num_replicas": 2, "max_ongoing_requests": 64}
    lm["placement"] = {"bundles": [{"CPU": 0.5, "moonserve_lm": 1}], "strategy": "STRICT_PACK"}
    # Two engines on two cores: one unbound OpenMP thread each; their steps paced.
    lm["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                 "MOONSERVE_STEP_PACE_S": str(STEP_S)}
    # Two DraftService shards, one per node.
    args["draft"]["deployment"] = {"num_replicas": 2, "max_ongoing_requests": 64,
                                   "resources": {"moonserve_draft": 1}}
    return data


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    nodes = TwoNodeCluster(root)
    try:
        yield nodes.start()
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs Debian's prometheus package (README setup)")
    server = Prometheus(cluster.temp_dir / "prom_metrics_service_discovery.json",
                        tmp_path_factory.mktemp("prom"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    (port,) = free_ports(1)
    config = root / "two-nodes.yaml"
    config.write_text(yaml.safe_dump(two_node_config(port)))
    process = ServerProcess(
        [sys.executable, "-m", "moonserve.pipeline.app.cli", "serve", "--config", str(config),
         "--address", cluster.address],
        f"http://127.0.0.1:{port}/health", log_path=root / "moonserve-serve.log",
        env=cluster.env, start_timeout_s=420)
    process.start()
    try:
        wait_for_replicas(cluster, "LanguageModel", 2, timeout_s=300)
        yield process.base_url
    finally:
        process.stop()


def join(address: str) -> None:
    """Join the cluster from a child process started with `cluster.env` (Ray reads the token from
    the environment the process started with), once per process."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)


def lm_counter(address: str, key: str) -> dict[str, int]:
    """In the `lm_counts` child: one counter of each LanguageModel replica's `stats()`."""
    from ray import serve

    join(address)
    handle = serve.get_deployment_handle("LanguageModel", app_name=APP)
    return {name: stats[key] for name, stats in replica_stats(handle, 2).items()}


def ongoing_requests(address: str, actor_names: list[str]) -> dict[str, int]:
    """In the `lm_counts` child: each named replica actor's ongoing requests, asked of the actor
    itself (the queue-length probe Serve's handles send), not through a handle: under load a
    handle sends every call to the lighter replica, so `replica_stats` may never reach the other."""
    import ray

    join(address)
    return {name: ray.get(ray.get_actor(name, namespace="serve").get_num_ongoing_requests.remote())
            for name in actor_names}


@pytest.fixture(scope="module")
def lm_counts(cluster, app):
    """`lm_counts.stats(key)`: each LanguageModel replica's `stats()[key]`, asked through a Serve
    handle in a spawned child joined to the cluster; `lm_counts.ongoing(actor_names)`: those
    replicas' ongoing requests, from the same child. A handle in the test process would keep Serve's
    client state for this cluster, and the session server's handles in later tests would wait
    on replicas that are gone. The child starts with the cluster's environment: Ray reads the
    token from the environment the process started with."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in cluster.env.items():
            env.setenv(name, value)
        pool = multiprocessing.get_context("spawn").Pool(1)
    with pool:
        yield SimpleNamespace(
            stats=lambda key: pool.apply(lm_counter, (cluster.address, key)),
            ongoing=lambda names: pool.apply(ongoing_requests, (cluster.address, names)))
        pool.terminate()


def running(cluster: TwoNodeCluster, deployment: str) -> list[dict]:
    return [r for r in cluster.serve_replicas(APP).get(deployment, [])
            if r.get("state") == "RUNNING"]


def wait_for_replicas(cluster: TwoNodeCluster, deployment: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(running(cluster, deployment)) != n:
        assert time.monotonic() < deadline, \
            f"{deployment}: not {n} running replicas: {cluster.serve_replicas(APP)}"
        time.sleep(2)


def wait_for_one_replica_per_node(cluster: TwoNodeCluster, deployment: str,
                                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = sorted(node_ids(cluster))
        placed = sorted(r["node_id"] for r in running(cluster, deployment))
        if placed == nodes:
            return
        assert time.monotonic() < deadline, f"{deployment}: running on {placed}, nodes {nodes}"
        time.sleep(2)


def node_ids(cluster: TwoNodeCluster) -> tuple[str, str]:
    """(head, worker) node ids of the live nodes."""
    nodes = cluster.alive_nodes()
    head = next(n["raylet"]["nodeId"] for n in nodes if n["raylet"].get("isHeadNode"))
    others = [n["raylet"]["nodeId"] for n in nodes if n["raylet"]["nodeId"] != head]
    return head, (others[0] if others else "")


@dataclass
class Outcome:
    """What the client saw of one request."""

    status: int | None = None
    tokens: int = 0
    error: str | None = None  # an error body or error event
    done: bool = False
    exception: str | None = None  # no answer at all: the request is lost to the client
    ended_at: float = 0.0

    @property
    def kind(self) -> str:
        if self.exception is not None:
            return "lost"
        if self.status != 200:
            return "failed" if self.error else "lost"
        if self.error is not None:
            return "failed" if self.done else "lost"
        return "completed" if self.done else "lost"


async def chat(http: httpx.AsyncClient, url: str, content: str, max_tokens: int,
               started: asyncio.Event | None = None, sampling: dict | None = None) -> Outcome:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    out = Outcome()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = json.dumps(event["error"])
                    elif event.get("usage"):
                        out.tokens = event["usage"]["completion_tokens"]
                    elif started is not None:
                        started.set()
    except httpx.HTTPError as e:
        out.exception = repr(e)
    out.ended_at = time.monotonic()
    return out


def per_instance(prometheus: Prometheus, promql: str) -> dict[int, float]:
    """Each series' value by the port of the node it was scraped from."""
    return {int(s["metric"]["instance"].rsplit(":", 1)[1]): float(s["value"][1])
            for s in prometheus.query(promql) if "instance" in s["metric"]}


def lm_instances(cluster: TwoNodeCluster) -> set[int]:
    """Both nodes' metrics-export ports."""
    return set(cluster.metrics_ports())


def test_each_node_runs_one_language_model_replica(cluster, app):
    head, worker = node_ids(cluster)
    assert worker, cluster.alive_nodes()
    lm = running(cluster, "LanguageModel")
    assert sorted(r["node_id"] for r in lm) == sorted([head, worker]), lm
    assert {r["node_id"] for r in running(cluster, "Router")} == {head}
    assert sorted(r["node_id"] for r in running(cluster, "DraftService")) == \
        sorted([head, worker])


async def test_prometheus_scrapes_every_node(cluster, app, prometheus):
    async with httpx.AsyncClient(timeout=120) as http:
        outcomes = await asyncio.gather(*(chat(http, app, f"Say {k}.", 8) for k in range(4)))
        assert [o.kind for o in outcomes] == ["completed"] * 4, outcomes
        # Two runs (stop 29's CI, one in stop 30) saw every target up but no engine gauge from
        # either node for minutes after four requests had ended. The cause is not known; engines
        # record their gauges only at engine steps, so requests keep coming while the test
        # waits, with distinct prompts for both replicas, and a failure names the nodes that
        # export any vLLM series at all.
        deadline = time.monotonic() + 120
        k = 4
        while True:
            up = {int(t["labels"]["instance"].rsplit(":", 1)[1]) for t in prometheus.targets()
                  if t["health"] == "up"}
            engines = set(per_instance(prometheus, "ray_vllm_num_requests_running"))
            if lm_instances(cluster) <= up and lm_instances(cluster) <= engines:
                break
            assert time.monotonic() < deadline, {
                "up": up, "engines": engines,
                "any_vllm_series": set(per_instance(prometheus, '{__name__=~"ray_vllm_.*"}'))}
            await asyncio.gather(*(chat(http, app, f"Count to {k + i}.", 4) for i in range(2)))
            k += 2
            await asyncio.sleep(2)


async def test_each_conversation_stays_on_the_replica_holding_its_prefix(lm_counts, app):
    """Prefix-affinity routing across the nodes: a conversation's first turn goes where
    power of two choices sends it, every later turn to the replica holding its prefix."""
    rng = random.Random(3)
    async with httpx.AsyncClient(timeout=300) as http:
        for k in range(4):
            before = await asyncio.to_thread(lm_counts.stats, "num_requests")
            messages = [{"role": "system",
                         "content": f"Conversation {k}. {filler_text(rng, 150)}"}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn}: why?"})
                r = await http.post(f"{app}/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                messages.append({"role": "assistant",
                                 "content": r.json()["choices"][0]["message"]["content"]})
            after = await asyncio.to_thread(lm_counts.stats, "num_requests")
            # Power of two choices alone keeps all three together one time in four.
            assert sorted(after[name] - before.get(name, 0) for name in after) == [0, 3], k


async def test_each_responses_session_stays_on_one_replica(lm_counts, app):
    """Turns that continue by `previous_response_id` send only their new input: the Router
    rebuilds the conversation from the store and routes it by its prefix (and by the session's
    key), so every turn of a session lands on one replica."""
    rng = random.Random(5)
    async with httpx.AsyncClient(timeout=300) as http:
        for k in range(3):
            before = await asyncio.to_thread(lm_counts.stats, "num_requests")
            previous = None
            for turn in range(3):
                body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0,
                        "input": f"Session {k}. {filler_text(rng, 150)}" if turn == 0
                        else f"Question {turn}: why?"}
                if previous is not None:
                    body["previous_response_id"] = previous
                r = await http.post(f"{app}/v1/responses", json=body)
                assert r.status_code == 200, r.text
                previous = r.json()["id"]
            after = await asyncio.to_thread(lm_counts.stats, "num_requests")
            assert sorted(after[name] - before.get(name, 0) for name in after) == [0, 3], k


async def test_killing_the_worker_node_under_load_loses_no_request(cluster, app, lm_counts):
    # Greedy, 1 to 5 tokens a paced step (the drafts the tiny model's repeats get accepted): 10
    # to 50 s, running when the node dies.
    streams, stream_tokens = 6, 1000
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as http:
        started = [asyncio.Event() for _ in range(streams)]
        long = [asyncio.create_task(chat(http, app, f"Tell story {k}.", stream_tokens, e))
                for k, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 240)
        # Both replicas hold some of them, asked of the replica actors themselves: Prometheus's
        # view lags by Ray's 10 s metrics report, and on a fast machine the streams can end
        # inside that lag (CI, stop 49: no node seen busy in 60 s).
        replicas = await asyncio.to_thread(running, cluster, "LanguageModel")
        ongoing = await asyncio.to_thread(lm_counts.ongoing, [r["actor_name"] for r in replicas])
        assert len(ongoing) == 2 and all(n > 0 for n in ongoing.values()), \
            (ongoing, [t.done() for t in long])

        cluster.worker.kill_raylet()
        killed_at = time.monotonic()
        new, declared_dead_at = [], None
        while declared_dead_at is None or time.monotonic() < declared_dead_at + 10:
            new.append((time.monotonic(), asyncio.create_task(
                chat(http, app, f"Question {len(new)}?", 16))))
            await asyncio.sleep(0.5)
            if declared_dead_at is None and len(await asyncio.to_thread(cluster.alive_nodes)) == 1:
                declared_dead_at = time.monotonic()
            assert time.monotonic() - killed_at < 180, "the worker node was never declared dead"
        long_outcomes = await asyncio.gather(*long)
        new_outcomes = [(sent, await task) for sent, task in new]

    kinds = [o.kind for o in long_outcomes]
    assert "lost" not in kinds, long_outcomes
    # The worker's streams end with an error event and [DONE], the head's finish.
    assert kinds.count("failed") >= 1 and kinds.count("completed") >= 1, long_outcomes
    for o in long_outcomes:
        if o.kind == "completed":
            assert o.tokens == stream_tokens, o
        else:
            assert o.status == 200 and o.done, o
            assert o.ended_at - killed_at < 60, f"a stream of the dead node hung: {o}"
    assert [o.kind for _, o in new_outcomes].count("lost") == 0, new_outcomes
    # Requests sent once the node was declared dead never try it.
    after = [o for sent, o in new_outcomes if sent > declared_dead_at]
    assert after and all(o.kind == "completed" and o.tokens == 16 for o in after), after
    failed = [(round(sent - killed_at, 1), o.status, (o.error or "")[:120])
              for sent, o in new_outcomes if o.kind == "failed"]
    print(f"\nworker raylet killed: long streams {kinds}; {len(new_outcomes)} new requests, "
          f"{[o.kind for _, o in new_outcomes].count('completed')} completed; node declared "
          f"dead after {declared_dead_at - killed_at:.1f} s; failed new requests (s after the "
          f"kill, status, error): {failed}")


async def test_the_node_rejoins_and_both_replicas_serve_again(cluster, app, prometheus):
    await asyncio.to_thread(cluster.rejoin_worker)
    # One running replica on each live node. Serve can still list a replica of the old worker
    # as running (with no node id) while it notices the node is gone, so a count is not enough.
    await asyncio.to_thread(wait_for_one_replica_per_node, cluster, "LanguageModel", 300)
    await asyncio.to_thread(wait_for_one_replica_per_node, cluster, "DraftService", 120)
    done = "sum by (instance) (ray_vllm_request_success_total)"
    # Steps each DraftService shard drafted, by node (a shard sent elsewhere while its replica
    # was down has gone home: the resolvers ask again every 10 s).
    drafted = 'sum by (instance) (ray_moonserve_draft_step_seconds_count)'
    before, drafted_before = per_instance(prometheus, done), per_instance(prometheus, drafted)
    # Rounds of 12 requests until both nodes' counters rose: a Router replica learns of the new
    # LanguageModel replica from Serve's long poll, which can come after the dashboard shows it
    # running, and a round sent before then goes to the old replica only.
    deadline = time.monotonic() + 90
    async with httpx.AsyncClient(timeout=300) as http:
        while True:
            outcomes = await asyncio.gather(*(chat(http, app, f"Count to {k}.", 32)
                                              for k in range(12)))
            assert [o.kind for o in outcomes] == ["completed"] * 12, outcomes
            await asyncio.sleep(5)  # Ray's metrics export and Prometheus's scrape
            after, drafted_after = per_instance(prometheus, done), per_instance(prometheus, drafted)
            served = {i for i in lm_instances(cluster) if after.get(i, 0) > before.get(i, 0)}
            shards = {i for i in lm_instances(cluster)
                      if drafted_after.get(i, 0) > drafted_before.get(i, 0)}
            if served == shards == lm_instances(cluster):
                break
            assert time.monotonic() < deadline, {"served": served, "drafted": shards}


def scrape_health(prometheus: Prometheus) -> list[tuple]:
    return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in prometheus.targets()]


def grafana_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((REPO / "configs" / "grafana" / "moonserve.json").read_text())
    return [(p["title"], t["expr"].replace("$application", APP))
            for p in dashboard["panels"] for t in p["targets"]]


async def test_every_grafana_panel_query_returns_a_series(app, prometheus):
    """Rounds of a mix that sets every panel's series, until each query returns one: beside the
    other pytest-xdist worker, a round's gauges can reach Prometheus late, and a gauge that is
    not set again can leave it."""
    from tests.payloads import data_url, png

    image = data_url(png((98, 70), (5, 6, 7)))
    deadline = time.monotonic() + 180
    async with httpx.AsyncClient(timeout=300) as http:
        while True:
            await grafana_mix(http, app, image)
            await asyncio.sleep(5)  # Ray's metrics export and Prometheus's scrape
            empty = [(title, q) for title, q in grafana_queries() if not prometheus.query(q)]
            if not empty:
                break
            assert time.monotonic() < deadline, \
                f"queries without a series: {empty}; scrape targets: {scrape_health(prometheus)}"


async def grafana_mix(http: httpx.AsyncClient, app: str, image: str) -> None:
    from tests.payloads import image_chat

    # Greedy, the tiny model's repeats take the drafts; sampled, its random tokens reject the
    # copies drafted from the prompt until the request pauses (quiet rows).
    for prompt in copy_prompts(2):
        for temperature in (0.0, 1.0):
            r = await http.post(f"{app}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 48, "temperature": temperature})
            assert r.status_code == 200, r.text
    for _ in range(2):  # an encoder cache miss, then a hit
        r = await http.post(f"{app}/v1/chat/completions", json={
            "model": MODEL, "messages": image_chat(image), "max_tokens": 4})
        assert r.status_code == 200, r.text
    outcomes = await asyncio.gather(*(chat(http, app, f"Hello {k}", 24) for k in range(4)))
    assert [o.kind for o in outcomes] == ["completed"] * 4, outcomes


def test_the_dashboard_shows_both_nodes_after_login_with_the_token(cluster, app, tmp_path):
    """The Serve page with every deployment, and the Cluster page with each node's replicas, as
    a user sees them after pasting the token the README names."""
    if shutil.which("chromium") is None:
        pytest.skip("needs Debian's chromium package (README setup)")
    from playwright.sync_api import sync_playwright

    head, worker = node_ids(cluster)
    shots = [tmp_path / name for name in DOCS_SCREENSHOTS]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{cluster.dashboard_url}/#/serve/applications/{APP}")
            page.get_by_text("Authentication Token Required").wait_for(timeout=60_000)
            page.get_by_role("textbox", name="Authentication Token").fill(cluster.token)
            page.get_by_role("button", name="Submit").click()
            for deployment in DEPLOYMENTS:
                page.get_by_text(deployment, exact=True).first.wait_for(timeout=60_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots[0]), full_page=True)
            page.goto(f"{cluster.dashboard_url}/#/cluster")
            page.get_by_text(worker[:8]).first.wait_for(timeout=60_000)
            for node in page.locator("tbody tr").filter(
                    has=page.locator("td:first-child button")).all():
                if "DEAD" not in node.inner_text():  # a node lost earlier stays listed
                    node.locator("td:first-child button").click()
            page.get_by_text("LanguageModel").nth(1).wait_for(timeout=60_000)
            page.wait_for_timeout(2000)
            # The whole list in one viewport (a full-page shot repeats the sticky header).
            page.set_viewport_size({"width": 1600, "height": page.evaluate(
                "document.documentElement.scrollHeight")})
            page.screenshot(path=str(shots[1]))
            text = page.inner_text("body")
        finally:
            browser.close()
    if os.environ.get("MOONSERVE_UPDATE_DOCS"):
        for shot in shots:
            (REPO / "docs" / "images").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, REPO / "docs" / "images" / shot.name)
    assert head in text and worker in text, text
    assert text.count("ServeReplica:moonserve:LanguageModel") == 2, text  # one on each node


SESSIONS = "sessions"  # the Router app of the stored-turns test


def deploy_session_routers(address: str, database: str, http_port: int) -> None:
    """Run in a child joined to the cluster: a second Router app at `/sessions`, two replicas
    (one per node: `max_replicas_per_node: 1`), its stored turns in `database`, bound to the app's
    LanguageModel (no third engine)."""
    from ray import serve

    from moonserve.deployments.builder import bind_router, resolve_model_path
    from moonserve.pipeline.config import AppConfig

    join(address)
    args = two_node_config(http_port)["applications"][0]["args"]
    args["router"]["deployment"] = {"num_replicas": 2, "max_replicas_per_node": 1,
                                    "max_ongoing_requests": 256}
    args["router"]["responses"] = {"database": database}
    config = AppConfig.model_validate(args)
    lm = serve.get_deployment_handle("LanguageModel", app_name=APP)
    serve.run(bind_router(config.router, lm, resolve_model_path(config.language_model),
                          chat=config.language_model.chat, drain_s=config.drain_s()),
              name=SESSIONS, route_prefix=f"/{SESSIONS}")


def delete_session_routers(address: str) -> None:
    from ray import serve

    join(address)
    serve.delete(SESSIONS)


def in_child(cluster: TwoNodeCluster, function: str, *args) -> None:
    call = f"from tests.cluster.test_two_nodes import {function} as f; f(*{args!r})"
    done = subprocess.run([sys.executable, "-c", call], env=cluster.env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


async def test_stored_turns_in_redis_are_read_by_router_replicas_on_both_nodes(
        cluster, app, prometheus, redis_url):
    """`router.responses.database: redis://...` on a cluster: a turn stored through either
    node's Router replica is read and continued through the other's (a per-node SQLite file
    would answer about half of these with a 404)."""
    import openai

    in_child(cluster, "deploy_session_routers", cluster.address, redis_url,
             int(app.rsplit(":", 1)[1]))
    try:
        head, worker = node_ids(cluster)
        routers = [r for r in cluster.serve_replicas(SESSIONS).get("Router", [])
                   if r.get("state") == "RUNNING"]
        assert sorted(r["node_id"] for r in routers) == sorted([head, worker]), routers
        client = openai.AsyncOpenAI(base_url=f"{app}/{SESSIONS}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
        served = 'sum by (replica) (ray_serve_deployment_request_counter_total' \
            f'{{application="{SESSIONS}",deployment="Router"}})'
        first = await client.responses.create(input="Hi", **ask)
        turns = await asyncio.gather(*(client.responses.create(
            input=f"And {k}?", previous_response_id=first.id, **ask) for k in range(8)))
        read = await asyncio.gather(*(client.responses.retrieve(t.id) for t in turns * 2))
        assert [r.output_text for r in read] == [t.output_text for t in turns * 2]
        assert all(t.usage.input_tokens > first.usage.input_tokens for t in turns)
        # Both replicas answered some of those (Serve's request counter, per replica).
        deadline = time.monotonic() + 30
        while len(by_replica := {s["metric"]["replica"]: float(s["value"][1])
                                 for s in prometheus.query(served)}) < 2:
            assert time.monotonic() < deadline, by_replica
            await asyncio.sleep(2)
        assert all(n > 0 for n in by_replica.values()), by_replica
    finally:
        in_child(cluster, "delete_session_routers", cluster.address)


SCALED_STREAMS = 4
# Sampled, undrafted, one token a paced step: 30 s, past Serve's 20 s drain (a stream that
# outlasts the drain is one a broken drain would cut).
SCALED_STREAM_TOKENS = 600


async def test_scaling_the_language_model_down_under_load_cuts_no_stream(cluster, app, lm_counts):
    """Ray's own scale call (the dashboard's REST API; the app runs with
    `external_scaler_enabled`) takes the LanguageModel from two replicas to one under load: the
    replica that goes drains its streams, the other keeps serving, nothing is restarted. Last in
    the module: the app keeps one replica after it."""
    async with httpx.AsyncClient(timeout=600) as http:
        started = [asyncio.Event() for _ in range(SCALED_STREAMS)]
        # Seeded sampled requests are not drafted for: the streams go at the engines' own pace.
        streams = [asyncio.create_task(chat(http, app, f"Tell story {k}.", SCALED_STREAM_TOKENS,
                                            e, sampling={"temperature": 1.0, "seed": k}))
                   for k, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 180)
        replicas = await asyncio.to_thread(running, cluster, "LanguageModel")
        # Both replicas hold streams: the one scaled away has some to drain.
        assert len(replicas) == 2, replicas
        ongoing = await asyncio.to_thread(lm_counts.ongoing, [r["actor_name"] for r in replicas])
        assert all(n > 0 for n in ongoing.values()), ongoing
        scaled = time.monotonic()
        r = await http.post(f"{cluster.dashboard_url}/api/v1/applications/{APP}/deployments/"
                            "LanguageModel/scale", json={"target_num_replicas": 1},
                            headers={"Authorization": f"Bearer {cluster.token}"})
        assert r.status_code == 200, r.text
        during = await chat(http, app, "hi", 4)
        outcomes = await asyncio.gather(*streams)
        drained_s = time.monotonic() - scaled
    assert [(o.kind, o.tokens) for o in outcomes] == \
        [("completed", SCALED_STREAM_TOKENS)] * SCALED_STREAMS, outcomes
    assert during.kind == "completed", during
    assert drained_s > 20, drained_s  # past Serve's default graceful shutdown
    await asyncio.to_thread(wait_for_replicas, cluster, "LanguageModel", 1, 60)
    assert [r["replica_id"] for r in running(cluster, "LanguageModel")][0] in \
        {r["replica_id"] for r in replicas}, "the replica that stayed was restarted"
