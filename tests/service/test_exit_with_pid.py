"""A service started by a process that is then killed (a test run stopped by its timeout, a
notebook kernel restarted) stops by itself: ``LocalService`` ties it to its starter with
``--exit-with-pid``, and nothing of it, Ray included, is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from trainctl.service.cluster import live_processes

from helpers.servicekit import fresh_home

STARTER = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from trainctl.local import LocalService

    svc = LocalService(Path(sys.argv[1]), env={k: v for k, v in eval(sys.argv[2]).items()})
    threading.Thread(target=svc.start, daemon=True).start()
    while svc.proc is None:
        time.sleep(0.05)
    print(svc.proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_service_whose_starter_was_killed_stops_and_leaves_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(data), repr(fresh_home(data))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    service_pid = int(starter.stdout.readline())
    time.sleep(3)  # the service is starting: Ray's head is coming up
    starter.send_signal(signal.SIGKILL)  # no teardown of any kind runs in the starter
    starter.wait()
    deadline = time.monotonic() + 120
    while live_processes(sid=service_pid) and time.monotonic() < deadline:
        time.sleep(1)
    left = live_processes(sid=service_pid)
    if left:
        os.killpg(service_pid, signal.SIGKILL)
    log = (data / "serve.log").read_text(errors="replace")
    assert not left, f"still running 120 s after its starter died: {left}\n{log}"
    assert f"process {starter.pid} (--exit-with-pid) is gone" in log, log
