"""The ``fused_head`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    v, h, chunk = (32_768, 64, 1024) if quick else (151_936, 64, 1024)
    lengths = (2048, 8192) if quick else (8192, 32_768, 131_072)
    rows = []
    for n in lengths:
        logits_gib = n * v * 4 / (1 << 30)
        fused = measure("fused_head_case", variant="fused", n=n, h=h, v=v, chunk=chunk)
        if n == lengths[0]:
            unfused = measure("fused_head_case", variant="unfused", n=n, h=h, v=v, chunk=chunk)
            unfused_cell = f"{unfused['peak_MiB'] / 1024:.2f} GiB (measured)"
            unfused_gib = unfused["peak_MiB"] / 1024
        else:
            # Logits and their gradient, fp32: does not fit in this machine's 24 GiB.
            unfused_gib = 2 * logits_gib
            unfused_cell = f"{unfused_gib:.1f} GiB (computed: logits + gradient)"
        ratio = unfused_gib * 1024 / fused["peak_MiB"]
        rows.append(
            [
                str(n),
                f"{logits_gib:.2f}",
                unfused_cell,
                f"{fused['peak_MiB']:.0f} MiB",
                f"{fused['grads_MiB']:.0f} MiB",
                f"{ratio:.0f}x",
                f"{fused['time_s']:.1f}",
            ]
        )
    head = (
        f"### Fused LM head + log-prob: vocab {v}, hidden {h}, chunks of {chunk} tokens, fp32, "
        "peak above the inputs over forward + backward (target: >= 20x lower at 32K)\n\n"
    )
    return head + table(
        [
            "tokens", "logits GiB", "unfused peak", "fused peak", "of which dh + dW",
            "unfused / fused", "fused time (s)",
        ],
        rows,
    )  # fmt: skip
