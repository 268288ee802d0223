"""Injected faults: a rank told to fail at a phase of its work (operators' drills and the
reliability tests, through Ray only: never on the HTTP API)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

FAULT_PHASES = (
    "forward",
    "accumulate_end",
    "forward_backward_end",
    "finish_window",
    "optimizer",
    "optimizer_end",
    "publish",
    "broadcast_stall",
)
BROADCAST_STALL_S = 10.0
"""How long rank 0 stops after the first bucket of a broadcast told to stall (a drill: an
engine lost, or hung, while the others wait mid-broadcast)."""


class InjectedFault(RuntimeError):
    """Raised by a rank told to fail (``Faults.arm``)."""


class Faults:
    """The faults armed on one rank. Owns the count of failures left per phase and which of
    them kill the process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._left: dict[str, int] = {}
        self._kills: set[str] = set()

    def arm(self, phase: str, times: int = 1, kill: bool = False) -> None:
        """Make the next ``times`` calls of ``phase`` raise: ``forward`` (before any work: the
        peers then block in a collective), ``accumulate_end`` (after phase 1, peers done),
        ``optimizer`` (phase 2, before the update), ``optimizer_end`` (after this rank's
        update, before it answers and before the ZeRO-1 all-gather). ``kill``: the process
        dies there instead (SIGKILL: a crash, nothing cleaned up). ``broadcast_stall``
        raises nothing: rank 0's next ``times`` broadcasts to the samplers stop
        ``BROADCAST_STALL_S`` after their first bucket (``stall``)."""
        if phase not in FAULT_PHASES:
            raise ValueError(f"phase must be one of {FAULT_PHASES}, not {phase!r}")
        self._left[phase] = times
        self._kills.discard(phase)
        if kill:
            self._kills.add(phase)

    def check(self, phase: str) -> None:
        """Fail here if ``phase`` is armed (raise, or die with ``kill``)."""
        if self._take(phase):
            if phase in self._kills:
                log.error("injected crash in %s on rank %d", phase, self.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault in {phase} on rank {self.rank}")

    def point(self, phase: str, *, undo: Callable[[], None]) -> None:
        """``check`` at the end of ``phase``, after ``undo`` took back its work."""
        try:
            self.check(phase)
        except InjectedFault:
            undo()
            raise

    def stall(self) -> Callable[[int], None] | None:
        """The pause a broadcast makes after bucket ``i`` when ``broadcast_stall`` is armed:
        ``BROADCAST_STALL_S`` after the first; None when it is not."""
        if not self._take("broadcast_stall"):
            return None

        def after(i: int) -> None:
            if i == 0:
                time.sleep(BROADCAST_STALL_S)

        return after

    def _take(self, phase: str) -> bool:
        if self._left.get(phase, 0) <= 0:
            return False
        self._left[phase] -= 1
        return True
