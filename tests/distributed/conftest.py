"""Rank pools live for the whole tier: starting torch and megatron-core costs seconds per
process, so every test module shares one pool per world size; they close when the run leaves
this folder (``helpers/tiers.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.rankpool import RankPool
from helpers.tiers import close_with_tier

IDLE_WINDOW_S = 3.0
MAX_IDLE_THREADS = 32
"""A pool worker between cases: the main thread, queue feeders, the default group's gloo
threads. Hundreds mean some case's process groups outlived it."""
_idle_report: list[str] = []


def _threads_and_cpu_s(pid: int) -> tuple[int, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return threads, ticks / os.sysconf("SC_CLK_TCK")


def _report_idle(started: dict[int, RankPool]) -> list[str]:
    """Each pool worker's threads and CPU use while idle, once the tier is done; returns the
    workers with more than ``MAX_IDLE_THREADS`` threads."""
    crowded = []
    pids = {pid: ws for ws, pool in started.items() for pid in pool.pids}
    before = {}
    for pid in pids:
        try:
            before[pid] = _threads_and_cpu_s(pid)
        except OSError:  # a worker that died (its test failed and says so)
            continue
    time.sleep(IDLE_WINDOW_S)
    for pid, ws in sorted(pids.items(), key=lambda kv: kv[1]):
        if pid not in before:
            continue
        threads, cpu = _threads_and_cpu_s(pid)
        busy = 100 * (cpu - before[pid][1]) / IDLE_WINDOW_S
        line = (
            f"pool {ws} worker {pid}: {threads} threads, {busy:.1f}% CPU idle "
            f"(pool restarted {started[ws].restarts}x after cases that left groups alive)"
        )
        _idle_report.append(line)
        if threads > MAX_IDLE_THREADS:
            crowded.append(line)
    return crowded


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _idle_report:
        terminalreporter.section("rank pools after the distributed tier")
        for line in _idle_report:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], RankPool]]:
    started: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in started:
            started[world_size] = RankPool(world_size)
        return started[world_size]

    def finish() -> None:
        if not started:
            return
        # A pool whose last case left groups alive would have been replaced before its next
        # case: it is closed unmeasured (its restarts are counted), not started again only to
        # be measured (seconds of CPU per rank, with the other xdist worker waiting on it).
        for ws in [ws for ws, pool in started.items() if pool.dirty]:
            _idle_report.append(f"pool {ws}: its last case left groups alive; closed unmeasured")
            started.pop(ws).close()
        crowded = _report_idle(started)
        for pool in started.values():
            pool.close()
        started.clear()
        assert not crowded, f"pool workers kept more than {MAX_IDLE_THREADS} threads: {crowded}"

    close_with_tier("distributed", finish)  # the pools end with the tier, not the session
    yield get
    finish()


@pytest.fixture
def pool1(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(1)


@pytest.fixture
def pool2(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(2)
