"""Real peak-memory measurement on CPU: the process's resident set, not shapes.

Each measurement runs in a fresh process with glibc told to serve every allocation above 64 KiB
by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at once and the
peak resident set tracks the peak of live memory. ``PeakRSS`` resets the kernel's high-water
mark (``/proc/self/clear_refs``) and reads it back (``VmHWM``), as a sync's ranks do.
"""

from __future__ import annotations

import os

from trainctl.workers.rank.stream import HostPeak

MIB = 1 << 20

CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


class PeakRSS(HostPeak):
    """``with PeakRSS() as m: work()`` then ``m.peak_above_start`` in bytes (the service's own
    measure of a sync's peak, ``HostPeak``, which must work here: Linux)."""

    @property
    def peak_above_start(self) -> int:
        if self.bytes is None:
            raise OSError("no /proc/self/clear_refs: peak memory is measured on Linux only")
        return self.bytes


def child_env() -> dict[str, str]:
    return {**os.environ, **CHILD_ENV}
