"""The ``step`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    n_seqs, seq_len, steps = (4, 128, 2) if quick else (16, 256, 5)
    rows = []
    for name, layout in (
        ("dp1", {"dp": 1}),
        ("dp2", {"dp": 2}),
        ("cp2", {"dp": 1, "cp": 2}),
        ("tp2", {"dp": 1, "tp": 2}),
    ):
        r = measure("step_case", layout=layout, n_seqs=n_seqs, seq_len=seq_len, steps=steps)
        rows.append(
            [
                name,
                f"{r['tokens_per_s']:.0f}",
                f"{r['step_s'] * 1e3:.0f}",
                f"{r['forward_s'] * 1e3:.0f}",
                f"{r['backward_s'] * 1e3:.0f}",
                f"{r['grad_sync_s'] * 1e3:.0f}",
                f"{r['optimizer_s'] * 1e3:.0f}",
            ]
        )
    head = (
        f"### Train step of the embedded model (2 layers, hidden 128, vocab 512): "
        f"{n_seqs} x {seq_len} tokens, one thread per rank, median of {steps} steps\n\n"
        "backward = forward/backward minus forward and the DP/CP gradient all-reduce; TP "
        "and CP communication inside the layers is counted in forward and backward.\n\n"
    )
    return head + table(
        [
            "layout",
            "tokens/s",
            "step ms",
            "forward ms",
            "backward ms",
            "grad sync ms",
            "optimizer ms",
        ],
        rows,
    )
