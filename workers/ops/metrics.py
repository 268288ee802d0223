"""CP-invariant metrics (docs/algorithms.md §1.7), each named with its reduction.

A metric is recorded from a rank's local tensors and reduced over an explicit process group,
so the exported value does not depend on how tokens were split over DP x CP ranks:
    ``name:mean``  ``sum(mask * v) / sum(mask)``: numerator and denominator are all-reduced
                   separately (never a mean of per-rank means);
    ``name:sum``   all-reduced sum;
    ``name:min`` / ``name:max``  all-reduced min / max over masked values.
Token counts come from the masks of the local shards, which partition the global micro-batch:
their sum is the global count on any layout.

The tracker refuses zero-element tensors (a dummy micro-batch must never reach it), and a
per-sequence perplexity sums its partial NLL and token count over CP *before* dividing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class Reduction(str, Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


@dataclass
class _Entry:
    reduction: Reduction
    num: Tensor  # float64 scalar
    den: Tensor  # float64 scalar (MEAN only)


def _all_reduce(x: Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


_OP = {
    Reduction.SUM: dist.ReduceOp.SUM,
    Reduction.MEAN: dist.ReduceOp.SUM,
    Reduction.MIN: dist.ReduceOp.MIN,
    Reduction.MAX: dist.ReduceOp.MAX,
}


def _nonempty(name: str, x: Tensor) -> None:
    if x.numel() == 0:
        raise ValueError(f"metric {name!r}: tensors must be non-empty")


class StatsTracker:
    """Accumulates masked statistics over micro-batches, then reduces them over a group. Owns the
    accumulated sums and their denominators."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._denominators: dict[str, Tensor] = {}

    def denominator(self, **masks: Tensor) -> None:
        """Register bool masks by name; each is also exported as ``name:sum`` (a count)."""
        for name, mask in masks.items():
            _nonempty(name, mask)
            if mask.dtype != torch.bool:
                raise TypeError(f"denominator {name!r} must be a bool tensor, got {mask.dtype}")
            self._denominators[name] = mask
            self._add(name, Reduction.SUM, mask.sum(dtype=torch.float64), None)

    def stat(
        self, *, denominator: str, reduction: Reduction = Reduction.MEAN, **values: Tensor
    ) -> None:
        """Record ``values`` (same shape as the named mask) reduced over the masked elements."""
        self.stats(values, denominator=denominator, reduction=reduction)

    def stats(
        self,
        values: dict[str, Tensor],
        *,
        denominator: str,
        reduction: Reduction = Reduction.MEAN,
    ) -> None:
        """``stat`` with the metrics' names as data (a name made at run time)."""
        mask = self._denominators[denominator]
        for name, v in values.items():
            _nonempty(name, v)
            if v.shape != mask.shape:
                raise ValueError(
                    f"metric {name!r} has shape {tuple(v.shape)}, its denominator "
                    f"{denominator!r} has {tuple(mask.shape)}"
                )
            v = v.detach().double()
            if reduction is Reduction.MIN:
                num = torch.where(mask, v, torch.inf).min()
            elif reduction is Reduction.MAX:
                num = torch.where(mask, v, -torch.inf).max()
            else:
                num = (v * mask).sum()
            self._add(name, reduction, num, mask.sum(dtype=torch.float64))

    def scalar(self, name: str, value: float, reduction: Reduction = Reduction.SUM) -> None:
        """A plain scalar (e.g. a loss term already scaled), reduced as ``reduction``.

        Under ``MEAN`` each record counts once: records of 1.0 and 3.0, on one rank or on two,
        export 2.0.
        """
        num = torch.tensor(float(value), dtype=torch.float64)
        one = torch.ones((), dtype=torch.float64) if reduction is Reduction.MEAN else None
        self._add(name, reduction, num, one)

    def ensure(self, keys: list[tuple[str, Reduction]]) -> None:
        """Make ``name:reduction`` present for every key, recording nothing new: a rank with no
        real tokens (only dummies) still joins each metric's collective, with the reduction's
        identity (0 / 0 for a mean, 0, +inf for a min, -inf for a max)."""
        identity = {Reduction.MIN: torch.inf, Reduction.MAX: -torch.inf}
        for name, reduction in keys:
            if f"{name}:{reduction.value}" not in self._entries:
                num = torch.tensor(identity.get(reduction, 0.0), dtype=torch.float64)
                self._add(name, reduction, num, torch.zeros((), dtype=torch.float64))

    def _add(self, name: str, reduction: Reduction, num: Tensor, den: Tensor | None) -> None:
        key = f"{name}:{reduction.value}"
        den = torch.zeros((), dtype=torch.float64) if den is None else den
        old = self._entries.get(key)
        if old is None:
            self._entries[key] = _Entry(reduction, num, den)
        elif reduction is Reduction.MIN:
            old.num = torch.minimum(old.num, num)
        elif reduction is Reduction.MAX:
            old.num = torch.maximum(old.num, num)
        else:
            old.num, old.den = old.num + num, old.den + den

    def export(
        self, *, group: ProcessGroup | None = None, key: str | None = None
    ) -> dict[str, float]:
        """Reduce over ``group`` (collective: every rank calls it with the same keys) and clear.

        ``key`` exports (and clears) that one metric, leaving the others recorded.
        """
        keys = sorted(self._entries) if key is None else [key]
        out = {}
        for k in keys:
            e = self._entries.pop(k)
            num = _all_reduce(e.num.clone(), _OP[e.reduction], group)
            if e.reduction is Reduction.MEAN:
                den = _all_reduce(e.den.clone(), dist.ReduceOp.SUM, group)
                out[k] = float(num / den) if den > 0 else float("nan")
            else:
                out[k] = float(num)
        if key is None:
            self._denominators.clear()
        return out
