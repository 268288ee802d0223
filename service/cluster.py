"""A local Ray head in its own process session, owned by ``trainctl serve``.

``ray.init()`` would start Ray's daemons in the caller's process group, so a Ctrl-C in the
terminal (or a signal to the group) kills the raylet before trainctl can drain, and Serve's
shutdown then hangs. Started in a session of its own, the head only stops when trainctl says
so: SIGTERM to the whole session, then SIGKILL after a grace period, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

_GRACE_S = 1.0
"""How long the Ray head may take to exit on SIGTERM before it is killed. It runs when our
actors are gone and every checkpoint is written; the raylet and the GCS then hold nothing we
keep, yet wait out timeouts of their own (about 15 s measured) before exiting, so a longer
grace only delays every stop (it was 3 s: the whole of it, every time)."""


DEFAULT_WORKER_PORTS = "10002-19999"
"""The local Ray head's worker port range unless ``--ray-worker-ports`` says otherwise."""


def free_port() -> int:
    """A TCP port free now, outside the kernel's ephemeral range and the default Ray worker
    ports (see :func:`quiet_ports`): for a server a caller starts a moment later."""
    low, high = DEFAULT_WORKER_PORTS.split("-")
    return quiet_ports(1, avoid=(int(low), int(high)))[0]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def quiet_ports(n: int, *, avoid: tuple[int, int]) -> list[int]:
    """``n`` distinct ports free on every interface now, drawn at random from outside the
    kernel's ephemeral range and outside ``avoid`` (a ``low, high`` range, inclusive).

    A port from ``bind(0)`` lies in the ephemeral range, which is also where every outgoing
    connection takes its source port: on a busy machine one of them can take the port in
    the moment between our check and the daemon's bind. Outside that range only a process
    that names the port can take it.
    """
    eph = _ephemeral_range()
    pool = [
        p
        for p in range(1024, 65536)
        if not (eph[0] <= p <= eph[1]) and not (avoid[0] <= p <= avoid[1])
    ]
    picked: list[int] = []
    for port in random.sample(pool, len(pool)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == n:
            return picked
    raise RuntimeError(f"fewer than {n} free ports outside {eph} and {avoid}")


HEAD_PORTS = (
    "port", "ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
    "node-manager-port", "object-manager-port",
)  # fmt: skip
"""The ``ray start`` port flags trainctl fills itself, with ports free when it starts the
head; the autoscaler's metrics port (``AUTOSCALER_METRIC_PORT``) too. Left to Ray, several
are fixed (8265, 10001, 44217, 52365) or taken at random later, and one of them could be
the port a caller picked for the gateway."""

STARTED = b"Ray runtime started."
"""What ``ray start`` writes once the head node is up."""

HEAD_DAEMONS = frozenset({"gcs_server", "raylet"})
"""The head's daemons by process name: one that exits before the node is up failed it."""

HEAD_ATTEMPTS = 3
"""How many times ``trainctl serve`` starts its local head, on fresh ports each time, before
it gives up: a port checked free can still be taken before Ray binds it, and Ray then
exits instead of picking another."""


class LocalRayHead:
    """``with LocalRayHead(num_cpus, log_path) as address: ray.init(address=address)``."""

    def __init__(
        self, *, num_cpus: int | None, log_path: Path, worker_ports: str = DEFAULT_WORKER_PORTS
    ) -> None:
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.worker_ports = worker_ports
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self._log_start = 0
        self.ports: dict[str, int] = {}
        """Every port the head was told to use, by its ``ray start`` flag."""
        self._held: socket.socket | None = None
        """A listener on the autoscaler's metrics port, on the loopback, while the head runs."""

    def __enter__(self) -> str:
        low, high = self.worker_ports.split("-")
        picked = quiet_ports(len(HEAD_PORTS) + 1, avoid=(int(low), int(high)))
        self.ports = dict(zip(HEAD_PORTS, picked, strict=False))
        port = self.ports["port"]
        cmd = [
            sys.executable,
            "-m",
            "trainctl.service.head_guard",  # kills the head at once if trainctl dies
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            *[f"--{flag}={p}" for flag, p in self.ports.items()],
            f"--min-worker-port={low}",
            f"--max-worker-port={high}",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ]
        self.ports["autoscaler-metrics"] = picked[-1]
        # Ray serves its metrics without auth, on every interface: the node's own (trainctl
        # has its own /metrics) are switched off, and the autoscaler's port is held on the
        # loopback, so its server cannot bind (the autoscaler logs that and runs on).
        self._release_held()  # an earlier attempt's
        self._held = socket.create_server(("127.0.0.1", picked[-1]))
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting a local Ray head on port %d (log: %s)", port, self.log_path)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as out:
            env = {
                **os.environ,
                "AUTOSCALER_METRIC_PORT": str(picked[-1]),
                "RAY_enable_metrics_collection": "0",
            }
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )  # fmt: skip
        self.address = f"127.0.0.1:{port}"
        return self.address

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until ``ray start`` reports the node up (True), or the start fails (False):
        ``ray start`` exits, or one of the head's daemons (``HEAD_DAEMONS``) exits before the
        node is up.

        Joining a head whose daemon died on a taken port can hang ``ray.init`` for many
        minutes; ``ray start`` itself gives up about 30 s after its raylet died on one, and a
        daemon that exited during start-up never comes back, so the start has failed then.
        """
        deadline = time.monotonic() + timeout_s
        seen: set[str] = set()
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(self._log_start)
                if STARTED in f.read():
                    return True
            if not self.running():
                return False
            assert self.proc is not None
            alive = {p.split(":", 1)[1] for p in live_processes(pgid=self.proc.pid)}
            if gone := sorted(seen - alive):
                log.warning("the local Ray head's %s exited during start-up", ", ".join(gone))
                return False
            seen |= alive & HEAD_DAEMONS
            time.sleep(0.2)
        return self.running()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _release_held(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def stop(self) -> None:
        if self.proc is None:
            self._release_held()
            return
        pgid = self.proc.pid  # session leader: its pid is the group id of every Ray process
        for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL above reaps it
            self.proc.wait(timeout=5)
        self.proc = None
        self._release_held()
        log.info("local Ray head stopped")


def live_processes(*, pgid: int | None = None, sid: int | None = None) -> list[str]:
    """``"pid:name"`` of the live (non-zombie) processes in a process group or session."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat.split(" (", 1)[1].rsplit(")", 1)[0]
        state, _ppid, pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if state == "Z":  # only their parent could reap them
            continue
        if (pgid is not None and int(pgrp) == pgid) or (sid is not None and int(session) == sid):
            out.append(f"{pid}:{name}")
    return out


def _group_alive(pgid: int) -> bool:
    return bool(live_processes(pgid=pgid))
