"""The ``fused_head`` tables of ``bench/run.py``: Qwen2.5/Qwen3's vocabulary, and Qwen3.5's."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    """Vocabulary 151,936 (Qwen2.5, Qwen3)."""
    if quick:
        return _table(32_768, (2048, 8192))
    return _table(151_936, (8192, 32_768, 131_072))


def section_qwen3_5(quick: bool) -> str:
    """Vocabulary 248,320 (Qwen3.5)."""
    return _table(65_536, (2048,)) if quick else _table(248_320, (8192, 32_768))


def _table(v: int, lengths: tuple[int, ...], h: int = 64, chunk: int = 1024) -> str:
    """Fused against unfused at ``v`` for each token count; the unfused head is measured at
    the first count and computed (its logits and their gradient, fp32) above it, where it
    does not fit in this machine's 24 GiB."""
    rows = []
    for n in lengths:
        logits_gib = n * v * 4 / (1 << 30)
        fused = measure("fused_head_case", variant="fused", n=n, h=h, v=v, chunk=chunk)
        if n == lengths[0]:
            unfused = measure("fused_head_case", variant="unfused", n=n, h=h, v=v, chunk=chunk)
            unfused_cell = f"{unfused['peak_MiB'] / 1024:.2f} GiB (measured)"
            unfused_gib = unfused["peak_MiB"] / 1024
        else:
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
