"""Bounded tables on a running service: 100,000 real HTTP calls into each table, and the RSS
of the gateway replica and of the controller actor after 10,000 and after 100,000.

    python bench/service_bounds.py                   # 100,000 calls per table
    python bench/service_bounds.py --quick           # 20,000
    python bench/service_bounds.py --tables handles  # one table, printed only

Starts `trainctl serve` (dp=1) and calls it as clients do, each call leaving an entry behind:
- controller, finished operations and their idempotency keys: `POST /v1/optim_step` with a
  new `Idempotency-Key` each time (no gradients wait, so each operation fails at once with a
  409 and is kept, with its key, until evicted);
- gateway, Tinker sessions: `POST /api/v1/create_session` (past the bound, a 429 until the
  oldest have been silent for 30 s, then they make room);
- gateway, Tinker model handles: `POST /api/v1/create_model` in one session (256 handles,
  then a 409 each).
Writes bench/results/service_bounds.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables.common import publish  # noqa: E402
from trainctl.local import LocalService  # noqa: E402

TINKER_KEY = {"X-API-Key": "tml-bench"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def find_pid(title: str) -> int:
    """The process whose command line (Ray sets it to ``ray::<actor class>...``) holds
    ``title``."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmd.startswith("ray::") and title in cmd:
                return int(p.name)
    raise LookupError(f"no process titled {title!r}")


def run(n: int, call: Callable[[int], None], pid: int) -> tuple[float, float, float]:
    """``n`` calls; the RSS (MiB) of ``pid`` at the start, after ``n // 10`` and after ``n``."""
    start = rss_mib(pid)
    marks = []
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
        if i + 1 in (n // 10, n):
            marks.append(rss_mib(pid))
            print(f"  {i + 1} calls, {time.perf_counter() - t0:.0f} s: {marks[-1]:.1f} MiB")
    return start, marks[0], marks[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}"
    )
    args = p.parse_args()
    n = 20_000 if args.quick else 100_000
    tables = args.tables.split(",")
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        p.error(f"--tables: unknown {unknown}")
    with tempfile.TemporaryDirectory(prefix="trainctl-bounds-") as tmp:
        svc = LocalService(Path(tmp) / "data", "--dp", "1", start_timeout_s=300).start()
        try:
            rows = measure(svc.url, n, tables)
        finally:
            svc.stop()
    header = (
        f"### Bounded tables on a running service: RSS of the process holding each table "
        f"after {n // 10:,} and after {n:,} real HTTP calls (`trainctl serve`, dp=1)\n\n"
        f"| table (process) | RSS at start (MiB) | after {n // 10:,} | after {n:,} | "
        f"growth from {n // 10:,} (MiB) | entries held at the end |\n|---|---|---|---|---|---|\n"
    )
    table = header + "\n".join(
        f"| {name} | {a:.1f} | {b:.1f} | {c:.1f} | {c - b:+.1f} | {held} |"
        for name, (a, b, c), held in rows
    )
    publish(table, "service_bounds", keep=n == 100_000 and len(tables) == len(TABLES))


TABLES = ("controller", "sessions", "handles")


def measure(
    url: str, n: int, tables: list[str]
) -> list[tuple[str, tuple[float, float, float], str]]:
    http = httpx.Client(base_url=url, timeout=60)
    controller, gateway = find_pid("ray::Controller"), find_pid("ServeReplica")
    rows = []
    if "controller" in tables:
        rows.append(_operations(http, n, controller))
    if "sessions" in tables:
        rows.append(_sessions(http, n, gateway))
    if "handles" in tables:
        rows.append(_handles(http, n, gateway))
    return rows


Row = tuple[str, tuple[float, float, float], str]


def _operations(http: httpx.Client, n: int, controller: int) -> Row:

    def optim_step(i: int) -> None:
        r = http.post("/v1/optim_step", json={}, headers={"Idempotency-Key": f"bounds-{i}"})
        assert r.status_code == 409, r.text  # no gradients wait: the operation fails at once

    print(f"controller (pid {controller}): {n:,} keyed optim_step operations")
    rss = run(n, optim_step, controller)
    return ("finished operations and keys (controller)", rss, "1,024 (its bound)")


def _sessions(http: httpx.Client, n: int, gateway: int) -> Row:
    def session(i: int) -> None:
        r = http.post("/api/v1/create_session", json={}, headers=TINKER_KEY)
        # Past 1,024 a new session takes the place of one silent for 30 s, or is a 429.
        assert r.status_code in (200, 429), r.text

    print(f"gateway (pid {gateway}): {n:,} Tinker sessions")
    return ("Tinker sessions (gateway)", run(n, session, gateway), "1,024 (its bound)")


def _handles(http: httpx.Client, n: int, gateway: int) -> Row:
    info = http.get("/v1/info").json()
    sid = http.post("/api/v1/create_session", json={}, headers=TINKER_KEY).json()["session_id"]
    body = {"session_id": sid, "base_model": info["model_name"], "lora_config": {"rank": 0}}

    def model(i: int) -> None:
        r = http.post("/api/v1/create_model", json={**body, "model_seq_id": i}, headers=TINKER_KEY)
        assert r.status_code == (200 if i < 256 else 409), r.text  # 256 handles a session

    print(f"gateway (pid {gateway}): {n:,} Tinker create_model calls in one session")
    handles = run(n, model, gateway)
    return ("Tinker model handles, one session (gateway)", handles, "256 (its bound)")


if __name__ == "__main__":
    main()
