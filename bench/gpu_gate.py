"""The correctness gate of the GPU benchmark: a row is published only if its step computes
what the reference step computes.

Every side starts from the same checkpoint and takes the same batch, so step 1 (before any
update) must give the same loss and the same gradient norm up to bf16 rounding, and training
on the batch must lower the loss. A step that skipped work (a layer's backward, a part of the
batch) changes the gradient norm and fails here, however fast it ran.

The reference is transformers with fp32 master weights under bf16 autocast: the most precise
of the configurations measured.
"""

from __future__ import annotations

import math
from typing import Any

LOSS_ABS = 2e-2
"""Step-1 loss: at most this far from the reference's (bf16: about 3 significant digits of a
loss near 12)."""
GRAD_NORM_REL = 0.02
"""Step-1 gradient norm: within this fraction of the reference's."""


def problems(row: dict[str, Any], reference: dict[str, Any] | None) -> list[str]:
    """Why ``row`` fails the gate against ``reference`` (empty: it passes). Both are the
    per-step records of ``Run.summary`` (``bench/gpu_timing.py``)."""
    if reference is None:
        return ["no reference row to compare with"]
    out: list[str] = []
    for who, r in (("row", row), ("reference", reference)):
        losses, norms = r.get("losses") or [], r.get("grad_norms") or []
        if len(losses) < 2 or not norms:
            out.append(f"{who}: fewer than 2 steps recorded")
            continue
        if not all(math.isfinite(x) for x in (*losses, *norms)):
            out.append(f"{who}: a non-finite loss or gradient norm")
            continue
        if not losses[-1] < losses[0]:
            out.append(f"{who}: loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    if out:
        return out
    loss, ref_loss = row["losses"][0], reference["losses"][0]
    if abs(loss - ref_loss) > LOSS_ABS:
        out.append(f"step-1 loss {loss:.4f} vs {ref_loss:.4f} (> {LOSS_ABS})")
    norm, ref_norm = row["grad_norms"][0], reference["grad_norms"][0]
    if abs(norm - ref_norm) > GRAD_NORM_REL * abs(ref_norm):
        out.append(
            f"step-1 grad norm {norm:.4g} vs {ref_norm:.4g} "
            f"({100 * abs(norm - ref_norm) / abs(ref_norm):.1f}% > {100 * GRAD_NORM_REL:.0f}%)"
        )
    return out
