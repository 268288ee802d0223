"""The ``recompute`` table of ``bench/run.py``."""

from __future__ import annotations

from typing import get_args

from bench.tables.common import measure, relative_rows, table
from trainctl.workers.engine.config import Recompute


def section(quick: bool) -> str:
    tokens = 2048 if quick else 8192
    runs = [
        (mode, measure("activation_case", recompute=mode, tokens=tokens))
        for mode in get_args(Recompute)
    ]
    head = (
        f"### Activation recomputation: one forward/backward of a {tokens}-token sequence, "
        "4 layers, hidden 256, 4 heads, fp32, peak above the weights\n\n"
    )
    return head + table(
        ["recompute", "peak MiB", "vs none", "forward+backward (s)", "time vs none"],
        relative_rows(runs),
    )
