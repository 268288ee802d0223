"""Timing one side's train step: warm-up, then timed steps each ended by a device
synchronize, the peak memory of the timed steps, the attention kernels of one profiled step,
and every step's loss and gradient norm from the first (the correctness gate reads them)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")


class OutOfMemory(Exception):
    """The step does not fit on the device in any configuration tried."""


@dataclass
class Run:
    """What one side's steps gave, step 1 (the shared starting weights) first."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    peak_gib: float = 0.0
    kernels: str = ""

    def summary(self) -> dict[str, Any]:
        return {
            "step_s": statistics.median(self.times),
            "min_s": min(self.times),
            "max_s": max(self.times),
            "steps": self.times,
            "peak_gib": self.peak_gib,
            "losses": self.losses,
            "grad_norms": self.grad_norms,
        }


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def _profiled(where: str | None) -> Iterator[None]:
    """A torch profiler whose table (by self device time) goes to ``where``; none without."""
    import torch

    if not where:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(where).write_text(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")


def attention_kernels(step: Callable[[], None]) -> str:
    """The attention kernels one run of ``step`` launched, or why there are none to read."""
    import torch

    if not torch.cuda.is_available():
        return "n/a (CPU)"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = sorted(
        {e.key for e in prof.key_averages() if any(k in e.key.lower() for k in ATTENTION_KERNELS)}
    )
    return "; ".join(n[:60] for n in names) or "none found"


def timed_run(
    run: Run, step: Callable[[], None], steps: int, warmup: int, profile: str | None
) -> None:
    """``warmup`` untimed runs of ``step``, then ``steps`` timed ones into ``run`` (the peak
    memory counter starts after the warm-up, so it holds the optimizer state), then one
    profiled run for the attention kernels."""
    import torch

    for _ in range(warmup):
        step()
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with _profiled(profile):
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            sync()
            run.times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        run.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    run.kernels = attention_kernels(step)
