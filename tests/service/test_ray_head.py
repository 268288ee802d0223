"""The local Ray head survives a port taken between our check and Ray's bind, and opens no
unauthenticated metrics server on every interface.

Run in a child process (a real ``ray start``, a real ``ray.init``) so the head and the
driver stay out of pytest's process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainctl.service import cluster

from helpers.servicekit import fresh_home

CHILD = """
import socket, sys, time
from pathlib import Path
import ray
from trainctl.service import cli, cluster

held = socket.socket()
held.bind(("", 0))
held.listen()
real, picks = cluster.quiet_ports, []

def first_pick_taken(n, *, avoid):
    ports = real(n, avoid=avoid)
    if not picks:  # the first head is told a port that someone else holds
        ports[cluster.HEAD_PORTS.index("node-manager-port")] = held.getsockname()[1]
    picks.append(ports)
    return ports

def wildcard_listeners(ports):
    # which of ports a socket listens on at every interface (from /proc/net/tcp*)
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.rsplit(":", 1)
            if state == "0A" and set(addr) == {"0"} and int(port, 16) in ports:
                out.add(int(port, 16))
    return out

cluster.quiet_ports = first_pick_taken
head = cluster.LocalRayHead(num_cpus=1, log_path=Path(sys.argv[1]) / "ray-head.log")
try:
    cli._start_head(head)
    print("heads started:", len(picks), "cpus:", ray.cluster_resources().get("CPU"))
    metrics = {head.ports["metrics-export-port"], head.ports["autoscaler-metrics"]}
    deadline = time.monotonic() + 10  # the metrics servers start a moment after the node
    while time.monotonic() < deadline and not wildcard_listeners(metrics):
        time.sleep(0.5)
    print("metrics on every interface:", sorted(wildcard_listeners(metrics)))
finally:
    ray.shutdown()
    head.stop()
"""


def test_a_head_whose_port_was_taken_is_started_again_on_other_ports(tmp_path: Path) -> None:
    env = {k: v for k, v in {**os.environ, **fresh_home(tmp_path / "d")}.items() if v is not None}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "heads started: 2 cpus: 1.0" in r.stdout, r.stdout
    # The re-probe's case: Ray's metrics servers (no auth) listened on every interface.
    assert "metrics on every interface: []" in r.stdout, r.stdout
    assert "exited during start-up (attempt 1 of 3" in r.stderr


def test_head_ports_stay_out_of_the_ephemeral_and_worker_ranges() -> None:
    low, high = cluster._ephemeral_range()
    ports = cluster.quiet_ports(200, avoid=(10002, 19999))
    assert len(set(ports)) == 200
    assert not [p for p in ports if low <= p <= high or 10002 <= p <= 19999]
