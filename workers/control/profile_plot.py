"""Pictures of memory profiles: allocated bytes over time, one PNG per rank (no torch).

Reads what ``workers/engine/profiling.py`` writes: the CPU profiler's Chrome trace (its ``[memory]``
instant events carry the running ``Total Allocated``) or the CUDA allocator snapshot pickle
(``device_traces``: alloc / free events with sizes, replayed into a running total).
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers): a snapshot holds nothing
    else, and a pickle naming any class or function is refused instead of run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a memory snapshot holds no {module}.{name}")


def memory_timeline(name: str, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds since the first event, allocated bytes)`` of one rank's profile file."""
    if name.endswith(".json"):
        trace = json.loads(data)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        mem = sorted(
            (e["ts"], e["args"]["Total Allocated"])
            for e in events
            if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
        )
        ts = np.array([t for t, _ in mem], dtype=np.float64) / 1e6
        total = np.array([b for _, b in mem], dtype=np.float64)
    elif name.endswith(".pickle"):
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
        deltas = []
        for trace in snapshot.get("device_traces", []):
            for e in trace:
                sign = {"alloc": 1, "free_completed": -1}.get(e.get("action"), 0)
                if sign:
                    deltas.append((e.get("time_us", 0), sign * e["size"]))
        deltas.sort()
        ts = np.array([t for t, _ in deltas], dtype=np.float64) / 1e6
        total = np.cumsum([d for _, d in deltas]).astype(np.float64)
    else:
        raise ValueError(f"{name}: not a memory profile this service writes")
    if ts.size:
        ts -= ts[0]
    return ts, total


def render_png(title: str, ts: np.ndarray, total: np.ndarray, marks: Sequence[str] = ()) -> bytes:
    """A step plot of allocated MiB over time, with the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    try:
        if ts.size:
            ax.step(ts, total / 2**20, where="post", linewidth=1.0, color="tab:blue")
            ax.fill_between(ts, total / 2**20, step="post", alpha=0.25, color="tab:blue")
            peak = int(np.argmax(total))
            ax.annotate(
                f"peak {total[peak] / 2**20:.1f} MiB",
                (ts[peak], total[peak] / 2**20),
                textcoords="offset points",
                xytext=(5, -12),
                fontsize=8,
            )
        else:
            ax.text(0.5, 0.5, "no allocations recorded", ha="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds since profile start")
        ax.set_ylabel("allocated (MiB)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)
