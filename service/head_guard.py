"""The local Ray head's guard: ``python -m trainctl.service.head_guard RAY_START_ARGV...``.

trainctl starts the guard as the leader of a new session; the guard runs ``ray start`` in its
own process group, where every Ray process of the head lands (GCS, raylet, agents, workers).

- **trainctl stops the head** by signalling that group (``LocalRayHead.stop``): ``ray start``
  shuts the head down gracefully, and the guard, which ignores the signal, exits with it.
- **trainctl dies** (SIGKILL, an OOM kill): the kernel sends the guard ``SIGUSR1``
  (``PR_SET_PDEATHSIG``) and the guard kills the whole group at once. A graceful shutdown
  would serve nobody then, and it took ``ray start`` about 30 s, during which the orphaned
  cluster held its ports, memory and CPU.

It imports nothing heavy: it starts in milliseconds, before ``ray start``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

PARENT_DIED = signal.SIGUSR1


def _kill_group(_signum: int, _frame: FrameType | None) -> None:
    os.killpg(0, signal.SIGKILL)  # the guard too: it is in the group


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, PARENT_DIED)


def main(argv: list[str]) -> int:
    parent = os.getppid()
    signal.signal(PARENT_DIED, _kill_group)
    _die_with_parent()
    if os.getppid() != parent:  # trainctl died before the death signal was armed
        _kill_group(PARENT_DIED, None)
    # A stop signals the whole group: ``ray start`` handles it; the guard waits for it.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    child = subprocess.Popen(argv, restore_signals=True, preexec_fn=_default_stop_signals)
    return child.wait()


def _default_stop_signals() -> None:
    """In ``ray start``, before it runs: the stop signals back to their defaults (ignored
    ones would be inherited) and ``PARENT_DIED`` too (only the guard acts on it)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, PARENT_DIED):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
