"""The ``checkpoint`` table of ``bench/run.py``."""

from __future__ import annotations

import tempfile
from typing import Any

from bench.tables.common import measure, table

WRITE = {"dp": 2}
SAME, OTHERS = [{"dp": 2}], [{"tp": 2}, {"dp": 1}]


def _name(layout: dict[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in layout.items())


def section(quick: bool) -> str:
    """Checkpoint size, save and load seconds of both formats, written at dp2 (ZeRO-1 on)
    and loaded at the same layout and at others."""
    rows = []
    for fmt in ("per_rank", "reshardable"):
        reads = SAME + (OTHERS if fmt == "reshardable" else [])
        with tempfile.TemporaryDirectory() as d:
            r: dict[str, Any] = measure(
                "checkpoint_case", module="checkpoint_cases", fmt=fmt, write=WRITE, reads=reads,
                directory=d, quick=quick,
            )  # fmt: skip
        refused = ["refused"] * (len(SAME + OTHERS) - len(reads))
        loads = [
            f"{s:.2f} / {b / 2**20:.0f}" for s, b in zip(r["load_s"], r["load_bytes"], strict=True)
        ] + refused
        verify = " / ".join([f"{v:.2f}" for v in r["verify_s"]] + ["-"] * len(refused))
        size = f"{r['size_bytes'] / 2**20:.0f}"
        rows.append([fmt, size, f"{r['save_s']:.2f}", *loads, verify])
    head = (
        f"### Checkpoint save and load ({r['parameters'] / 1e6:.0f}M-parameter model, fp32 "
        f"with AdamW, written at {_name(WRITE)} with ZeRO-1)\n\n"
        "Seconds of the slowest rank, each layout's ranks spawned processes over gloo; loads "
        "read files the save just wrote (in the page cache). A load's MiB: the most resident "
        "memory one rank added while it loaded (its staged copy of its state, and the pages "
        "of the files it touched). A save hashes each file as it writes it; a load first "
        "proves the files (each read by one loading rank: sha256, header, every tensor "
        "finite, the moments counted), and its seconds include that proof, which the verify "
        "column gives alone, per load layout. A per-rank checkpoint loads only into the "
        "layout that wrote it.\n\n"
    )
    return head + table(
        [
            "format",
            "size MiB",
            "save s",
            *(f"load at {_name(x)} s / MiB" for x in SAME + OTHERS),
            "verify s (" + " / ".join(_name(x) for x in SAME + OTHERS) + ")",
        ],
        rows,
    )
