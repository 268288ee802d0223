"""The ``cp_loss`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    t, v = (4096, 4096) if quick else (8192, 8192)
    rows = []
    for cp in (2, 4):
        local = measure("cp_loss_case", variant="cp_local", cp=cp, t=t, v=v)
        gather = measure("cp_loss_case", variant="gather", cp=cp, t=t, v=v)
        rows.append(
            [
                str(cp),
                f"{gather['peak_MiB']:.0f}",
                f"{local['peak_MiB']:.0f}",
                f"{local['peak_MiB'] / gather['peak_MiB']:.2f} (1/cp = {1 / cp:.2f})",
                f"{gather['bytes_sent'] / 2**20:.1f} MiB",
                f"{local['bytes_sent']:.0f} B",
            ]
        )
    head = (
        f"### CP-local loss vs gather-logits-then-loss: {t} tokens x {v} vocab per "
        f"micro-batch, fp32, per-rank peak over the loss (forward + backward)\n\n"
    )
    return head + table(
        [
            "cp",
            "gather: peak MiB",
            "CP-local: peak MiB",
            "ratio",
            "gather: sent per rank",
            "CP-local: sent per rank",
        ],
        rows,
    )
