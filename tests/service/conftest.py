"""One real trainctl service per test session: `trainctl serve` in its own process session,
real Ray, real Serve, real HTTP. Teardown sends SIGTERM, as Kubernetes does, and checks that
the service drained and exited cleanly with nothing left running."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainctl.clients import TrainctlClient
from trainctl.service.cluster import live_processes

START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120


@dataclass
class Service:
    url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self) -> TrainctlClient:
        return TrainctlClient(self.url, timeout=300)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_service(data_dir: Path, *flags: str) -> Iterator[Service]:
    """`trainctl serve FLAGS` until the block ends; then SIGTERM and a clean-exit check."""
    port = _free_port()
    log_path = data_dir / "serve.log"
    env = {**os.environ, "TRAINCTL_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "trainctl.service.cli",
        "serve",
        "--port",
        str(port),
        "--num-cpus",
        "2",
        *flags,
    ]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    svc = Service(url=f"http://127.0.0.1:{port}", data_dir=data_dir, proc=proc, log_path=log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    with svc.client() as c:
        while not c.is_ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"trainctl serve {' '.join(flags)} did not become ready:\n{svc.log()}")
            time.sleep(1)
    yield svc

    proc.send_signal(signal.SIGTERM)  # to the service's own pid only, as Kubernetes does
    try:
        rc = proc.wait(timeout=STOP_TIMEOUT_S)
    finally:
        leftovers = live_processes(sid=proc.pid)
        if proc.poll() is None or leftovers:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, f"trainctl serve exited with {rc}:\n{svc.log()}"
    assert not leftovers, f"processes left after shutdown: {leftovers}"
    assert "drained in-flight work" in svc.log()


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default: dp=2."""
    with running_service(tmp_path_factory.mktemp("trainctl-data")) as svc:
        yield svc
