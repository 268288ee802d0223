"""What every benchmark table uses: a measurement in a fresh process, and markdown tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.memory import child_env

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "run.py"


MEMORY_MODULES = ("cases", "parallel_cases", "tree_cases", "lora_cases", "checkpoint_cases")
"""The case modules that measure peak memory (``child_env``)."""


def measure(fn: str, module: str = "cases", **kwargs: Any) -> dict[str, float]:
    """Run ``bench.<module>.<fn>(**kwargs)`` in a fresh process and return its result.

    Memory cases (``cases``, ``parallel_cases``) run with ``child_env()`` (small allocations
    from mmap, so peaks are exact); the cases that start a service time it as users run it,
    with the plain environment.
    """
    job = json.dumps({"fn": fn, "module": module, "kwargs": kwargs})
    memory = module in MEMORY_MODULES
    env = child_env() if memory else {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(RUN), "--child", job],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"{fn}({kwargs}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def relative_rows(runs: list[tuple[str, dict[str, float]]]) -> list[list[str]]:
    """Peak and time of each run, and their ratios to the first run's."""
    base = runs[0][1]
    return [
        [
            label,
            f"{r['peak_MiB']:.0f}",
            f"{r['peak_MiB'] / base['peak_MiB']:.2f}",
            f"{r['time_s']:.1f}",
            f"{r['time_s'] / base['time_s']:.2f}",
        ]
        for label, r in runs
    ]
