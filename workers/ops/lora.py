"""LoRA's low-rank update on tensor-parallel linears: ``scaling * B @ A @ x`` beside ``W @ x``.

``A`` is ``[r, in]`` and ``B`` is ``[out, r]``; PEFT's ``scaling`` is ``alpha / r``. Under
tensor parallelism the factors are split as the base weight is (the textbook rules):

column-parallel (``W`` split on its output rows: q/k/v, fc1, the LM head)
    ``A`` replicated, ``B`` split on its output rows like ``W``. ``z = A x`` is the same on
    every TP rank; the backward sums ``dz`` over TP (each rank saw only its output rows).
    Under sequence parallelism each rank holds ``1 / tp`` of the tokens: ``z`` (``r`` wide) is
    all-gathered along the sequence instead of ``x`` (``in`` wide), and ``A``'s gradient is a
    partial sum over the rank's tokens (the caller marks ``A`` for a TP sum).
row-parallel (``W`` split on its input columns: attention out, fc2)
    ``A`` split on its input columns like ``W``, ``B`` replicated. ``z = sum over TP of
    A_k x_k`` is one all-reduce of an ``r``-wide tensor; the base output is reduced by the layer
    itself. Under sequence parallelism ``z`` is then cut to this rank's tokens, and ``B``'s
    gradient is a partial sum over them (the caller marks ``B`` for a TP sum).

MoE experts are whole on their rank (no expert tensor parallelism): ``grouped_delta`` gives
each expert's rows its own ``B_e A_e``, two grouped linears (``grouped_linear.py``), so an
expert that got no tokens still gets full-shape zero gradients.

Each function takes its process group and nothing from trainctl; a group of one (or None)
means no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.autograd import apply
from trainctl.workers.ops.grouped_linear import WgradOptions, grouped_linear


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_rows(x: Tensor, group: ProcessGroup | None) -> Tensor:
    out = x.new_empty((x.shape[0] * _size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _rank_rows(x: Tensor, group: ProcessGroup | None) -> Tensor:
    return x.chunk(_size(group), dim=0)[dist.get_rank(group)].contiguous()


def _reduce_scatter_rows(x: Tensor, group: ProcessGroup | None) -> Tensor:
    out = x.new_empty((x.shape[0] // _size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _identity(x: Tensor, group: ProcessGroup | None) -> Tensor:
    return x


Collective = Callable[[Tensor, "ProcessGroup | None"], Tensor]


class _Conjugate(torch.autograd.Function):
    """``forward(x)`` in the forward pass, ``backward(grad)`` in the backward pass: the four
    pairs below are each other's adjoints over the TP group."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, group: ProcessGroup | None, forward: Collective, backward: Collective
    ) -> Tensor:
        ctx.group, ctx.backward = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        return ctx.backward(g, ctx.group), None, None, None


def _sum_grad_over_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Identity forward; the backward sums the gradient over the group."""
    return apply(_Conjugate, x, group, _identity, _all_reduce)


def _sum_over_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-reduce forward; identity backward (every rank's part had the same effect)."""
    return apply(_Conjugate, x, group, _all_reduce, _identity)


def _gather_sequence(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather along dim 0 (the sequence); the backward reduce-scatters."""
    return apply(_Conjugate, x, group, _gather_rows, _reduce_scatter_rows)


def _scatter_sequence(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice along dim 0; the backward all-gathers."""
    return apply(_Conjugate, x, group, _rank_rows, _gather_rows)


def _down(x: Tensor, a: Tensor, dropout: float, training: bool) -> Tensor:
    if dropout > 0.0 and training:
        x = F.dropout(x, p=dropout, training=True)
    return F.linear(x, a.to(x.dtype))


def column_parallel_delta(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    scaling: float,
    *,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    dropout: float = 0.0,
    training: bool = False,
) -> Tensor:
    """The update to add to a column-parallel linear's output.

    ``x``: the layer's input ``[tokens (/ tp under SP), ..., in]``; ``a``: ``[r, in]``, the
    same on every TP rank; ``b``: this rank's ``[out / tp, r]`` rows. Returns
    ``[tokens, ..., out / tp]``, the shape of the layer's output.
    """
    z = _down(x, a, dropout, training)
    if _size(tp_group) > 1:
        z = _gather_sequence(z, tp_group) if sequence_parallel else _sum_grad_over_tp(z, tp_group)
    return F.linear(z, b.to(z.dtype)) * scaling


def row_parallel_delta(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    scaling: float,
    *,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    dropout: float = 0.0,
    training: bool = False,
) -> Tensor:
    """The update to add to a row-parallel linear's (reduced) output.

    ``x``: the layer's input ``[tokens, ..., in / tp]``; ``a``: this rank's ``[r, in / tp]``
    columns; ``b``: ``[out, r]``, the same on every TP rank. Returns ``[tokens (/ tp under SP),
    ..., out]``, the shape of the layer's reduced output.
    """
    z = _down(x, a, dropout, training)
    if _size(tp_group) > 1:
        z = _sum_over_tp(z, tp_group)
        if sequence_parallel:
            z = _scatter_sequence(z, tp_group)
    return F.linear(z, b.to(z.dtype)) * scaling


def grouped_delta(
    x: Tensor,
    m_splits: list[int],
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    scaling: float,
    *,
    dropout: float = 0.0,
    training: bool = False,
) -> Tensor:
    """The update to add to a grouped (per-expert) linear's output ``[M, out]``: expert ``e``'s
    ``m_splits[e]`` rows of ``x`` (``[M, in]``) get ``scaling * B_e A_e x``. A factor holding a
    ``main_grad`` (megatron's DDP) gets its gradient accumulated there, as the experts' weights
    do."""
    if dropout > 0.0 and training:
        x = F.dropout(x, p=dropout, training=True)
    opts = WgradOptions(fuse_wgrad_accumulation=hasattr(a[0], "main_grad"))
    z = grouped_linear(x, m_splits, a, opts=opts)
    return grouped_linear(z, m_splits, b, opts=opts) * scaling


def merged_weight(
    w: Tensor, a: Tensor, b: Tensor, scaling: float, *, tp_group: ProcessGroup | None
) -> Tensor:
    """``W + scaling * B @ A`` for a column-parallel weight ``W`` (``[out / tp, in]``, ``B``
    split like it, ``A`` replicated): the LM head's effective weight, for kernels that take a
    weight. ``A``'s gradient is summed over TP (each rank's rows saw only its outputs)."""
    if _size(tp_group) > 1:
        a = _sum_grad_over_tp(a, tp_group)
    return w + (b.to(w.dtype) @ a.to(w.dtype)) * scaling
