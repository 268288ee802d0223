"""The ``sequence_parallel`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, relative_rows, table


def section(quick: bool) -> str:
    tokens = 2048 if quick else 8192
    runs = [
        (
            mode,
            measure("sp_activation_case", "parallel_cases", sequence_parallel=mode, tokens=tokens),
        )
        for mode in ("off", "on")
    ]
    base = runs[0][1]["loss"]
    rows = [
        [*row, f"{abs(r['loss'] - base) / abs(base):.1e}"]
        for row, (_, r) in zip(relative_rows(runs), runs, strict=True)
    ]
    from bench.parallel_cases import SP_MODEL

    m = SP_MODEL
    head = (
        f"### Sequence parallelism at tp2: one forward/backward of a {tokens}-token sequence, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"{m['num_attention_heads']} heads, fp32; per-rank peak above the weights (the larger "
        "rank)\n\n"
        "Under sequence parallelism the norms, the residual stream and the inputs the linears "
        "keep for backward hold 1/tp of the tokens; attention and the MLP's inner activations "
        "are split by heads and columns either way.\n\n"
    )
    return head + table(
        ["sequence parallel", "peak MiB", "vs off", "forward+backward (s)", "time vs off",
         "loss rel. diff"],
        rows,
    )  # fmt: skip
