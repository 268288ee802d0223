"""The ``tree`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table

TREE_SHAPES = [
    "grpo-8-1024-256",
    "grpo-8-1024-1024",
    "grpo-16-1024-256",
    "grpo-16-1024-1024",
    "turns",
]


def section(quick: bool) -> str:
    """Tree against flat packing: train-step throughput beside the token ratio, attention time
    beside the ideal tree cost, and peak memory."""
    from bench.tree_cases import BUDGET, MODELS

    shapes = TREE_SHAPES[:1] + TREE_SHAPES[-1:] if quick else TREE_SHAPES
    rows, attention = [], []
    for model in MODELS:
        for shape in shapes:
            flat, tree = (
                measure("tree_step_case", "tree_cases", model=model, shape=shape, packing=p,
                        steps=1 if quick else 2)
                for p in ("flat", "tree")
            )  # fmt: skip
            speedup = flat["step_s"] / tree["step_s"]
            ratio = tree["tokens"] / tree["computed"]
            rows.append(
                [
                    model, shape, f"{flat['tokens']:.0f}", f"{tree['computed']:.0f}",
                    f"{flat['tokens'] / flat['step_s']:.0f}",
                    f"{tree['tokens'] / tree['step_s']:.0f}",
                    f"{speedup:.2f}", f"{ratio:.2f}", f"{speedup / ratio:.2f}",
                    f"{flat['peak_MiB']:.0f}", f"{tree['peak_MiB']:.0f}",
                ]
            )  # fmt: skip
            attention.append(
                [
                    model, shape, f"{flat['attention_s'] * 1e3:.0f}",
                    f"{tree['attention_s'] * 1e3:.0f}",
                    f"{flat['attention_s'] / tree['attention_s']:.2f}",
                    f"{flat['pairs'] / tree['pairs']:.2f}",
                ]
            )  # fmt: skip
    wide = MODELS["wide"]["model"]
    head = (
        "### Tree against flat packing: one rank, one train step (median of 2), budget "
        f"{BUDGET} tokens per micro-batch, max_seq_len 4096\n\n"
        "Shapes: `grpo-G-P-R` is G responses of R tokens to one P-token prompt; `turns` a "
        "512-token first turn, 4 second turns of 256, each with 2 third turns of 256. Models: "
        "the embedded one (2 layers, hidden 128, vocab 512) and a wide one (2 layers, hidden "
        f"{wide['hidden_size']}, ffn {wide['ffn_hidden_size']}, vocab {wide['vocab_size']}) "
        "where the MLP and the LM head dominate. tokens/s counts the batch's tokens; the token "
        "ratio is tokens / computed tokens. Target: speed-up >= 0.8 x the token ratio on the "
        "wide GRPO shapes.\n\n"
    )
    steps = table(
        ["model", "shape", "tokens", "computed", "flat tok/s", "tree tok/s", "speed-up",
         "token ratio", "speed-up / ratio", "flat peak MiB", "tree peak MiB"],
        rows,
    )  # fmt: skip
    attn = table(
        ["model", "shape", "flat attention ms", "tree attention ms", "time ratio",
         "ideal ratio (query-key pairs)"],
        attention,
    )  # fmt: skip
    return (
        head + steps + "\n\nCore attention, forward of one eval pass (all layers), against "
        "the ideal tree cost: the ratio of (query, key) pairs attended, flat over tree.\n\n" + attn
    )
