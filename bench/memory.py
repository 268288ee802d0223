"""Real peak-memory measurement on CPU: the process's resident set, not shapes.

Each measurement runs in a fresh process with glibc told to serve every allocation above 64 KiB
by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at once and the
peak resident set tracks the peak of live memory. ``PeakRSS`` resets the kernel's high-water
mark (``/proc/self/clear_refs``) and reads it back (``VmHWM``).
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1 << 20

CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRSS:
    """``with PeakRSS() as m: work()`` then ``m.peak_above_start`` in bytes."""

    def __enter__(self) -> PeakRSS:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_above_start = _status("VmHWM") - self.start


def child_env() -> dict[str, str]:
    return {**os.environ, **CHILD_ENV}
