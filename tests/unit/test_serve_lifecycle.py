"""`moonserve serve` around Ray: after `ray.shutdown` it ends every process of the local cluster it
started, orphans included (the live Ctrl-C test is the `server` fixture's teardown); at start it
says how into the dashboard, and where its Ray cluster is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import pytest


# A stand-in for a local Ray cluster on its way down: a child that ignores SIGTERM, and a
# grandchild orphaned when its parent exits (as a dashboard module is when its head dies).
SCRIPT = textwrap.dedent("""
    import json, subprocess, sys, time
    from moonserve.pipeline.app.server import become_subreaper, end_descendants

    become_subreaper()
    stubborn = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    parent = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE)
    orphan = int(parent.stdout.readline())
    parent.wait()
    time.sleep(0.5)
    print(json.dumps({"pids": [stubborn.pid, orphan]}), flush=True)
    end_descendants(1.0)
    print(json.dumps({"left": [p.pid for p in __import__("psutil").Process().children(True)]}))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_CHILD_SUBREAPER is Linux")
def test_end_descendants_ends_orphans_and_processes_that_ignore_sigterm():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    pids = json.loads(out[0])["pids"]
    assert json.loads(out[1])["left"] == []
    for pid in pids:
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_dashboard_line_says_how_to_log_in_when_ray_asks_for_a_token():
    from moonserve.pipeline.app.server import dashboard_login

    assert "`ray get-auth-token`" in dashboard_login({"RAY_AUTH_MODE": "token"})
    assert dashboard_login({"RAY_AUTH_MODE": "disabled"}) == ""
    assert dashboard_login({}) == ""


def test_the_ray_address_is_read_from_the_servers_log_and_its_absence_named(tmp_path):
    """Drivers (tests, benches) join the cluster at the address `moonserve serve` prints; the
    live line is read by every test of tests/server, this is the missing one."""
    from moonserve.pipeline.app.launch import RAY_ADDRESS_LINE, ServerFailed, ServerProcess

    log = tmp_path / "serve.log"
    process = ServerProcess(["moonserve", "serve"], "http://127.0.0.1:9/health", log_path=log)
    log.write_text("moonserve: starting\n")
    with pytest.raises(ServerFailed, match=f"{RAY_ADDRESS_LINE}.*{log}"):
        process.ray_address()
    log.write_text(f"moonserve: starting\n{RAY_ADDRESS_LINE}10.0.0.7:6379\nmoonserve: OpenAI API at ...\n")
    assert process.ray_address() == "10.0.0.7:6379"
