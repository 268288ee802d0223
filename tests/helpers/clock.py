"""Where a run's time went, by scheduling group: which worker ran it, when it started and
ended (minutes into the run), its tests' summed durations (setup, call and teardown), and the
idle time each worker had at the end. ``scripts/test`` prints it after the slowest-25 list;
it is what the order of ``tests/conftest.py``'s groups is tuned from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest


@dataclass
class _Group:
    worker: str
    start: float
    stop: float
    tests: set[str] = field(default_factory=set)
    seconds: float = 0.0


class GroupClock:
    """A pytest plugin (registered in the process that reports, the xdist controller)."""

    def __init__(self, group_of: Callable[[str], str]) -> None:
        self.group_of = group_of
        self.groups: dict[str, _Group] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        worker = getattr(gateway, "id", "main")
        name = self.group_of(report.nodeid)
        g = self.groups.setdefault(name, _Group(worker, report.start, report.stop))
        g.start, g.stop = min(g.start, report.start), max(g.stop, report.stop)
        g.tests.add(report.nodeid)
        g.seconds += report.duration

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.groups:
            return
        t0 = min(g.start for g in self.groups.values())
        end = max(g.stop for g in self.groups.values())
        w = terminalreporter
        w.section("time by scheduling group (tests/conftest.py group_of)")
        w.write_line(f"{'worker':<7}{'from':>7}{'to':>7}{'tests':>7}{'summed s':>10}  group")
        for name, g in sorted(self.groups.items(), key=lambda kv: (kv[1].worker, kv[1].start)):
            span = f"{g.worker:<7}{(g.start - t0) / 60:>6.1f}m{(g.stop - t0) / 60:>6.1f}m"
            w.write_line(f"{span}{len(g.tests):>7}{g.seconds:>10.1f}  {name}")
        for worker in sorted({g.worker for g in self.groups.values()}):
            last = max(g.stop for g in self.groups.values() if g.worker == worker)
            w.write_line(f"{worker}: idle for the last {(end - last) / 60:.1f} min")
        total = sum(g.seconds for g in self.groups.values())
        w.write_line(f"summed test durations: {total:.0f} s over {(end - t0):.0f} s of run")
