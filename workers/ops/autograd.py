"""Typed calls of custom autograd Functions.

torch leaves ``Function.apply`` unannotated (it returns whatever ``forward`` does), so the
ops call their Functions through these two and say once what comes back."""

from __future__ import annotations

import torch
from torch import Tensor


def apply(fn: type[torch.autograd.Function], *args: object) -> Tensor:
    """``fn.apply(*args)`` for a Function whose ``forward`` returns one tensor."""
    out: Tensor = fn.apply(*args)
    return out


def apply_pair(fn: type[torch.autograd.Function], *args: object) -> tuple[Tensor, Tensor]:
    """``fn.apply(*args)`` for a Function whose ``forward`` returns two tensors."""
    first, second = fn.apply(*args)
    return first, second
