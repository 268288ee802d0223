"""``trainctl serve`` as a child process: for benchmarks, tests and notebooks.

    with LocalService(Path("data"), "--dp=2") as svc:
        svc.client().train_batch(...)

Starts the service in its own process session (``env`` adds variables; a None value unsets
one), tied to this process (``--exit-with-pid``: killed, it still stops the service), waits
until ``/v1/ready``, and on exit sends
SIGTERM to the service's pid only (as Kubernetes does), waits for it, and kills whatever is
left of its session. ``returncode`` and ``leftovers`` say how the stop went.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from trainctl.clients import TrainctlClient
from trainctl.service.cluster import free_port, live_processes


class LocalService:
    def __init__(
        self,
        data_dir: Path,
        *flags: str,
        num_cpus: int = 2,
        start_timeout_s: float = 300,
        stop_timeout_s: float = 120,
        env: dict[str, str | None] | None = None,
    ) -> None:
        self.data_dir, self.flags = data_dir, flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / "serve.log"
        self.num_cpus, self.env = num_cpus, env or {}
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.instance = uuid.uuid4().hex[:16]
        """The identity this start reports at /v1/ready (``--instance-id``)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.leftovers: list[str] = []

    def client(self, **kwargs: Any) -> TrainctlClient:
        return TrainctlClient(self.url, timeout=300, **kwargs)

    def log(self) -> str:
        """The service's whole log (every check on it, e.g. that a secret never appears in it,
        reads all of it)."""
        return self.log_path.read_text(errors="replace")

    def start(self) -> LocalService:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        merged = {
            **os.environ,
            "TRAINCTL_DATA_DIR": str(self.data_dir),
            "TRAINCTL_INSTANCE_ID": self.instance,
            "TRAINCTL_EXIT_WITH_PID": str(os.getpid()),  # never outlives this process
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        env = {k: v for k, v in merged.items() if v is not None}  # None: unset
        cmd = [sys.executable, "-m", "trainctl.service.cli", "serve", "--port", str(self.port)]
        cmd += ["--num-cpus", str(self.num_cpus), *self.flags]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        with self.client() as c:
            while not c.is_ready(instance=self.instance):  # ours, not whatever took the port
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"trainctl serve {' '.join(self.flags)} did not become ready:\n{self.log()}"
                    )
                time.sleep(1)
        return self

    def stop(self) -> int:
        """SIGTERM to the service's pid; returns its exit status (killed: negative)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.returncode = None
        self.leftovers = live_processes(sid=self.proc.pid)
        if self.returncode is None or self.leftovers:
            self.kill()
        return self.returncode if self.returncode is not None else -9

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
