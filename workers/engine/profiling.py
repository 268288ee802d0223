"""Per-rank memory profiling between ``start`` and ``stop`` (docs/algorithms.md §6).

On CUDA: ``torch.cuda.memory`` allocation history, dumped as a snapshot pickle (viewable at
pytorch.org/memory_viz). On CPU: ``torch.profiler`` with memory profiling, exported as a
Chrome trace whose ``[memory]`` events record every allocation and free (viewable in Perfetto
or chrome://tracing). The CPU profiler has no ring buffer, so its recording is capped in time
instead: after ``cpu_max_seconds`` (10 minutes) the next pass stops it, and ``stop`` writes
what was recorded until then.

File names carry the global rank and the parallel coordinates:
``snapshot_rank{global:02d}_p{pp}d{dp}c{cp}t{tp}.pickle`` (CUDA) or ``….trace.json`` (CPU).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainctl.workers.engine.boundary import RankCoords

log = logging.getLogger(__name__)


class MemoryProfiler:
    """Records this rank's allocations between ``start`` and ``stop``. Owns the recording in
    progress."""

    def __init__(self, coords: RankCoords, cpu_max_seconds: float = 600.0) -> None:
        self.coords = coords
        self.cpu_max_seconds = cpu_max_seconds
        self._cpu_prof: Any = None
        self._cpu_recording = False
        self._cpu_deadline = 0.0
        self._cuda_active = False

    @property
    def active(self) -> bool:
        return self._cuda_active or self._cpu_prof is not None

    def pause_if_expired(self) -> bool:
        """Called before every pass: a CPU recording past its time cap stops recording (its
        events so far are kept for ``stop``), so its memory stops growing. True if it did."""
        if not self._cpu_recording or time.monotonic() < self._cpu_deadline:
            return False
        self._cpu_prof.__exit__(None, None, None)
        self._cpu_recording = False
        log.warning(
            "rank %d: the CPU memory profile reached its %.0f s cap; recording stopped, "
            "stop_memory_profile writes what was recorded", self.coords.rank,
            self.cpu_max_seconds,
        )  # fmt: skip
        return True

    def start(self, max_entries: int) -> None:
        if self.active:
            raise RuntimeError("a memory profile is already being recorded on this rank")
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=max_entries)
            self._cuda_active = True
            return
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=False,
        )
        prof.__enter__()
        self._cpu_prof, self._cpu_recording = prof, True
        self._cpu_deadline = time.monotonic() + self.cpu_max_seconds

    def stop(self, directory: Path) -> Path:
        """Stop recording and write this rank's file into ``directory``; returns its path."""
        if not self.active:
            raise RuntimeError("no memory profile is being recorded on this rank")
        directory.mkdir(parents=True, exist_ok=True)
        if self._cuda_active:
            path = directory / f"{self.coords.file_stem()}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_active = False
            return path
        prof, self._cpu_prof = self._cpu_prof, None
        if self._cpu_recording:
            prof.__exit__(None, None, None)
            self._cpu_recording = False
        path = directory / f"{self.coords.file_stem()}.trace.json"
        prof.export_chrome_trace(str(path))
        log.info("rank %d wrote memory profile %s", self.coords.rank, path)
        return path
