"""The ``state_bytes`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    """Bytes per parameter of training state on one rank: fp32 + Adam vs bf16 mixed precision,
    at dp 1, 2, 4, with and without ZeRO-1, beside the arithmetic bound."""
    rows = []
    for precision in ("fp32", "bf16"):
        for dp in (1, 2) if quick else (1, 2, 4):
            for zero in ("off", "on") if dp > 1 else ("off",):
                r = measure("state_bytes_case", dp=dp, precision=precision, zero=zero)
                # Parameters + fp32 main gradients + (bf16 only) fp32 master weights + Adam's
                # two fp32 moments; under ZeRO the last two are divided by dp.
                shard = dp if zero == "on" else 1
                bound = (4 + 4 + 8 / shard) if precision == "fp32" else (2 + 4 + 12 / shard)
                tensors = sum(r[f"{k}_per_param"] for k in ("params", "grads", "masters", "adam"))
                rows.append(
                    [
                        precision,
                        str(dp),
                        zero,
                        f"{r['params_per_param']:.2f}",
                        f"{r['grads_per_param']:.2f}",
                        f"{r['masters_per_param']:.2f}",
                        f"{r['adam_per_param']:.2f}",
                        f"**{tensors:.2f}**",
                        f"{bound:.2f}",
                        f"{r['rss_per_param']:.2f}",
                    ]
                )
    head = (
        f"### Training state per parameter on one rank ({r['parameters'] / 1e6:.1f}M-parameter "
        "model, after one step; the largest rank)\n\n"
        "Read off the rank's live tensors (each storage once), beside the bound "
        "(fp32: 4 + 4 + 8/d; bf16: 2 + 4 + (4 + 8)/d, d = dp under ZeRO-1, else 1) and the "
        "process's resident-set growth from before the engine was built (which also holds "
        "allocator slack, megatron's buffers and the step's leftovers).\n\n"
    )
    return head + table(
        ["precision", "dp", "ZeRO-1", "params", "main grads", "master weights", "Adam",
         "total B/param", "bound", "RSS growth B/param"],
        rows,
    )  # fmt: skip
