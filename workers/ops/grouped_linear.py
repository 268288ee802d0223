"""Grouped linear for MoE experts, correct when some or all experts get zero tokens
(docs/algorithms.md §5).

Input ``x [M, K]`` holds the tokens of ``E`` experts back to back (``m_splits[e]`` rows each);
expert ``e`` has ``W_e [N, K]`` and optionally ``b_e [N]``:
    forward   ``y = concat_e(x_e W_e^T + b_e)``                 ``[M, N]``
    backward  ``dgrad = concat_e(g_e W_e)``                      ``[M, K]``
              ``wgrad_e = g_e^T x_e``, ``bgrad_e = sum_rows g_e``  full shape, zero if ``m_e = 0``
An expert with no tokens still returns full-shape zero gradients, never None: other ranks hold
real gradients for the same parameters, and a missing one leaves a DDP bucket or hook unfired
and the all-reduce hangs. No host-side branch on ``sum(m_splits)``: a matmul with an inner
dimension of 0 is zeros, and a sum over 0 rows is zeros.

With ``fuse_wgrad_accumulation`` every weight carries an fp32 ``main_grad`` that the wgrad is
accumulated into (or written over, on the first micro-batch / with ``overwrite_main_grad``);
a weight marked ``grad_added_to_main_grad`` (megatron DDP) gets that flag set and a dummy wgrad
shaped like ``main_grad``, so autograd hooks still fire while DDP skips the add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainctl.workers.ops.autograd import apply


@dataclass(frozen=True, kw_only=True, slots=True)
class WgradOptions:
    fuse_wgrad_accumulation: bool = False
    is_first_microbatch: bool = False
    overwrite_main_grad: bool = False
    zero_out_wgrad: bool = False
    """The dummy wgrad returned with ``grad_added_to_main_grad`` is zero-filled."""


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        m_splits: list[int],
        opts: WgradOptions,
        num_experts: int,
        *params: Tensor,
    ) -> Tensor:
        weights, biases = params[:num_experts], params[num_experts:]
        xs = x.split(m_splits)
        ys = [xe @ w.t() for xe, w in zip(xs, weights, strict=True)]
        if biases:
            ys = [y + b for y, b in zip(ys, biases, strict=True)]
        ctx.save_for_backward(x, *weights)
        # The parameters themselves, for their main_grad: a saved-tensor hook may hand backward
        # other tensor objects than these, without the attribute (they are alive anyway).
        ctx.params = weights if opts.fuse_wgrad_accumulation else ()
        ctx.m_splits, ctx.opts, ctx.num_experts, ctx.has_bias = (
            m_splits,
            opts,
            num_experts,
            bool(biases),
        )
        return torch.cat(ys) if ys else x.new_zeros(0, 0)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        opts: WgradOptions = ctx.opts
        xs, gs = x.split(ctx.m_splits), g.split(ctx.m_splits)
        dgrad = torch.cat([ge @ w for ge, w in zip(gs, weights, strict=True)])
        wgrads: list[Tensor | None] = []
        for e, (ge, xe) in enumerate(zip(gs, xs, strict=True)):
            wgrad = ge.t() @ xe  # [N, K]; zeros when the expert had no tokens
            if opts.fuse_wgrad_accumulation:
                wgrads.append(_accumulate_main_grad(ctx.params[e], wgrad, opts))
            else:
                wgrads.append(wgrad)
        bgrads: list[Tensor | None] = [ge.sum(dim=0) for ge in gs] if ctx.has_bias else []
        return (dgrad, None, None, None, *wgrads, *bgrads)


def _accumulate_main_grad(w: Tensor, wgrad: Tensor, opts: WgradOptions) -> Tensor | None:
    main_grad: Tensor = getattr(w, "main_grad")
    accumulate = not opts.is_first_microbatch and not opts.overwrite_main_grad
    if accumulate:
        main_grad.add_(wgrad.to(main_grad.dtype))
    else:
        main_grad.copy_(wgrad)  # an empty expert writes 0, never leaves a stale gradient
    if hasattr(w, "grad_added_to_main_grad"):
        w.grad_added_to_main_grad = True
        make = torch.zeros if opts.zero_out_wgrad else torch.empty
        return make(main_grad.shape, dtype=w.dtype, device=w.device)
    return None


def grouped_linear(
    x: Tensor,
    m_splits: list[int],
    weights: Sequence[Tensor],
    biases: Sequence[Tensor] | None = None,
    opts: WgradOptions | None = None,
) -> Tensor:
    """``[M, K] -> [M, N]``, expert ``e`` applied to its ``m_splits[e]`` rows."""
    return apply(
        _GroupedLinear,
        x,
        list(m_splits),
        opts or WgradOptions(),
        len(weights),
        *weights,
        *(biases or []),
    )


class GroupedLinear(nn.Module):
    """``E`` linear layers ``K -> N``, one per expert, applied to grouped rows. Owns the experts'
    weights and biases."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            for _ in range(num_experts)
        )
        self.biases = (
            nn.ParameterList(
                nn.Parameter(torch.zeros(out_features, dtype=dtype)) for _ in range(num_experts)
            )
            if bias
            else None
        )
        for w in self.weights:
            nn.init.normal_(w, std=in_features**-0.5)

    def forward(self, x: Tensor, m_splits: list[int], opts: WgradOptions | None = None) -> Tensor:
        return grouped_linear(
            x, m_splits, list(self.weights), list(self.biases) if self.biases else None, opts
        )
