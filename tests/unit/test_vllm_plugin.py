"""pipeline/engine/vllm_plugin.py's waiting without spinning, on vLLM's own `SpinCondition`.

With `MOONSERVE_VLLM_SPIN=1` a reader of vLLM's shared-memory queues spins on `sched_yield` as
vLLM has it; once the plugin is registered without it (on CPU), the reader waits for the writer's
notification (a ZeroMQ socket) without spinning, and still wakes when the writer notifies. The
plugin patches vLLM's class for the whole process, so the test runs in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, time
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
from moonserve.pipeline.engine.vllm_plugin import register

yields = []
shm_broadcast.sched_yield = lambda: yields.append(1)
context = zmq.Context()


def waits():
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    time.sleep(0.2)  # the SUB socket's subscription reaches the PUB socket
    yields.clear()
    began = time.monotonic()
    for _ in range(5):
        reader.wait(timeout_ms=20)  # nothing written: a spinning reader yields, returns at once
    idle_s = time.monotonic() - began
    writer.notify()
    began = time.monotonic()
    reader.wait(timeout_ms=30_000)
    return {"yields": len(yields), "idle_s": idle_s, "woke_s": time.monotonic() - began}


os.environ["MOONSERVE_VLLM_SPIN"] = "1"
register()
spinning = waits()
del os.environ["MOONSERVE_VLLM_SPIN"]
register()
print(json.dumps({"spinning": spinning, "waiting": waits()}))
"""


def test_a_reader_waits_on_the_notification_without_spinning_and_wakes_when_notified():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["spinning"]["yields"] >= 5, result  # vLLM's own: each wait yields
    waiting = result["waiting"]
    assert waiting["yields"] == 0, result
    assert waiting["idle_s"] >= 5 * 0.015, result  # each wait blocked for about its timeout
    assert waiting["woke_s"] < 20, result  # the notification, not the 30 s timeout, ended it
