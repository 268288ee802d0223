"""The ``logprob`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    n, v = (2048, 4096) if quick else (8192, 8192)
    base = measure("logprob_case", variant="full", n=n, v=v, chunks=1, repeats=3)
    rows = [
        [
            "non-chunked (saves softmax)",
            "-",
            f"{base['peak_over_G']:.2f}",
            "-",
            f"{base['time_s'] * 1e3:.0f}",
            "1.00",
        ]
    ]
    for chunks in (4, 8, 16):
        for variant, label in (
            ("list_cat", "chunked, list + cat backward"),
            ("streamed", "chunked, streamed backward (ours)"),
        ):
            r = measure("logprob_case", variant=variant, n=n, v=v, chunks=chunks, repeats=3)
            target = f"<= {1 + 2 / chunks:.3f}" if variant == "streamed" else "~2"
            rows.append(
                [
                    label,
                    str(chunks),
                    f"{r['peak_over_G']:.3f}",
                    target,
                    f"{r['time_s'] * 1e3:.0f}",
                    f"{r['time_s'] / base['time_s']:.2f}",
                ]
            )
    head = (
        f"### Streamed vocab-parallel log-prob: forward + backward, {n} tokens x {v} vocab, "
        f"fp32 (G = full gradient = {base['G_MiB']:.0f} MiB)\n\n"
    )
    return head + table(
        ["kernel", "chunks", "peak above inputs / G", "target", "time (ms)", "time vs non-chunked"],
        rows,
    )
