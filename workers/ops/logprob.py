"""Vocab-parallel per-token log-probabilities (docs/algorithms.md §3).

TP rank ``k`` holds logits for vocabulary columns ``[vocab_start, vocab_start + V_t)``. The
log-softmax is computed without gathering the vocabulary: the row max and the sum of
exponentials are all-reduced over the TP group, and the target's log-prob comes from the rank
that owns the target column (all-reduce SUM; out-of-vocabulary targets give 0).

Two autograd functions with bit-identical gradients:
* ``_LogprobFull`` saves the fp32 softmax ``[N, V_t]`` for backward (about 2G of memory where
  G is the fp32 gradient's size);
* ``_LogprobChunked`` saves only the input logits plus the row max and log-sum-exp (``[N]``
  each) and, in backward, recomputes each chunk's softmax directly into one preallocated fp32
  gradient buffer: no list, no ``torch.cat``, peak about G plus one chunk in forward.

Both compute ``p = exp((x - m) - log_se)`` and the gradient ``p * (-g)`` then ``+ g`` scattered
at the target in the same order, so ``torch.equal`` holds between them.

Shapes: ``logits [..., V_t]``, ``target [...]`` int64 -> log-probs ``[...]`` fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.autograd import apply


def _all_reduce(x: Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


VOCAB_BLOCK = 4096
"""Columns summed as one block by ``_row_sum``; the block sums are then added left to right."""


def _row_sum(e: Tensor) -> Tensor:
    """Row sums ``[n, 1]`` of ``e [n, V]`` in an order fixed by ``V`` alone.

    ``e.sum(-1)`` is not: torch splits a single long row over threads, but gives each row of a
    many-row tensor to one thread, so the same row sums differently (by an ulp) depending on
    how many rows come with it - and the chunked kernel sees fewer rows than the full one.
    Here each ``VOCAB_BLOCK``-column block is a short row of its own (summed by one thread, the
    same way whatever ``n`` is) and the block sums are added in column order.
    """
    n, v = e.shape
    full = v - v % VOCAB_BLOCK
    parts = []
    if full:
        parts.append(e[:, :full].reshape(n, full // VOCAB_BLOCK, VOCAB_BLOCK).sum(-1))
    if full < v:
        parts.append(e[:, full:].sum(-1, keepdim=True))
    blocks = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    acc = blocks[:, :1].clone()
    for j in range(1, blocks.shape[1]):
        acc += blocks[:, j : j + 1]
    return acc


def _row_stats(x: Tensor, tp_group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, m, log_se)`` of rows ``x [n, V_t]``: ``z = x - m`` (new fp32 tensor), the row max
    ``m [n, 1]`` and ``log(sum(exp(z)))`` ``[n, 1]``, both reduced over the TP group."""
    m = _all_reduce(x.max(dim=-1, keepdim=True).values.float(), dist.ReduceOp.MAX, tp_group)
    z = x - m
    se = _all_reduce(_row_sum(z.exp()), dist.ReduceOp.SUM, tp_group)
    return z, m, se.log_()


def _log_softmax(x: Tensor, tp_group: ProcessGroup | None) -> Tensor:
    """Distributed log-softmax over the vocabulary of rows ``x [n, V_t]`` (fp32, new tensor)."""
    z, _, log_se = _row_stats(x, tp_group)
    return z.sub_(log_se)


def _local_target(target: Tensor, vocab_start: int, vocab_size_local: int) -> tuple[Tensor, Tensor]:
    """``(local column index, outside-this-partition mask)``; the index is 0 where outside."""
    outside = (target < vocab_start) | (target >= vocab_start + vocab_size_local)
    local = (target - vocab_start).masked_fill(outside, 0)
    return local, outside


def _pick(lsm: Tensor, local: Tensor, outside: Tensor) -> Tensor:
    return lsm.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)


def _grad_rows(p: Tensor, g: Tensor, local: Tensor, outside: Tensor) -> Tensor:
    """In place on the softmax rows ``p``: ``p * (-g)``, plus ``g`` at each in-partition target.

    ``p * (-g)`` equals ``(-p) * g`` bit for bit (negation is exact) and saves a pass.
    """
    p.mul_(g.neg().unsqueeze(-1))
    return p.scatter_add_(-1, local.unsqueeze(-1), g.masked_fill(outside, 0.0).unsqueeze(-1))


class _LogprobFull(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, tp_group: Any
    ) -> Tensor:
        z, _, log_se = _row_stats(logits.float(), tp_group)
        lsm = z.sub_(log_se)
        local, outside = _local_target(target, vocab_start, logits.shape[-1])
        lp = _all_reduce(_pick(lsm, local, outside), dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(lsm.exp_(), local, outside)
        ctx.in_dtype = logits.dtype
        return lp

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        p, local, outside = ctx.saved_tensors
        grad = _grad_rows(p.clone(), g, local, outside)
        return grad.to(ctx.in_dtype), None, None, None


class _LogprobChunked(torch.autograd.Function):
    """Forward keeps only the input logits and the per-row ``m``, ``log_se`` (``[n]`` each);
    backward writes each chunk's softmax gradient straight into one preallocated buffer."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, tp_group: Any, chunk: int
    ) -> Tensor:
        n = logits.shape[0]
        local, outside = _local_target(target, vocab_start, logits.shape[-1])
        m = torch.empty(n, 1, dtype=torch.float32, device=logits.device)
        log_se = torch.empty(n, 1, dtype=torch.float32, device=logits.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            _, m[a:b], log_se[a:b] = _row_stats(logits[a:b].float(), tp_group)
        # ((x - m) - log_se) at the target: the same operations, in the same order, as the
        # non-chunked kernel's log-softmax, so the two agree bit for bit.
        x_t = logits.gather(-1, local.unsqueeze(-1)).float()
        lp = (x_t - m).sub_(log_se).squeeze(-1).masked_fill_(outside, 0.0)
        _all_reduce(lp, dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(logits, local, outside, m, log_se)
        ctx.chunk = chunk
        return lp

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        logits, local, outside, m, log_se = ctx.saved_tensors
        n = logits.shape[0]
        # One buffer for the whole gradient; chunks tile [0, n) exactly once.
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            p = torch.sub(logits[a:b], m[a:b], out=grad[a:b]).sub_(log_se[a:b]).exp_()
            _grad_rows(p, g[a:b], local[a:b], outside[a:b])
        out = grad if logits.dtype == torch.float32 else grad.to(logits.dtype)
        return out, None, None, None, None


def vocab_parallel_logprob(
    logits: Tensor,
    target: Tensor,
    *,
    vocab_start: int = 0,
    tp_group: ProcessGroup | None = None,
    chunk_size: int = 0,
) -> Tensor:
    """Per-token log p(target) from vocab-sharded logits ``[..., V_t]``; returns fp32 ``[...]``.

    ``chunk_size`` > 0 and smaller than the number of rows selects the streamed kernel;
    otherwise the non-chunked one (a single chunk would keep logits *and* recompute).
    """
    lead = logits.shape[:-1]
    x = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    if 0 < chunk_size < x.shape[0]:
        lp = apply(_LogprobChunked, x, t, vocab_start, tp_group, chunk_size)
    else:
        lp = apply(_LogprobFull, x, t, vocab_start, tp_group)
    return lp.reshape(lead)


def _local_entropy(x: Tensor, tp_group: ProcessGroup | None) -> Tensor:
    """``-sum p log p`` over this TP rank's columns of rows ``x [n, V_t]`` (fp32); summed over
    the TP group, the rows' entropies."""
    lsm = _log_softmax(x, tp_group)
    # p * log p -> 0 as p -> 0: a -inf logit (masked or padded vocabulary) adds nothing,
    # where the plain product would be 0 * -inf = NaN.
    plogp = lsm.exp().mul_(lsm).masked_fill_(lsm == -torch.inf, 0.0)
    return _row_sum(plogp).squeeze(-1).neg_()


@torch.no_grad()
def vocab_parallel_entropy(
    logits: Tensor, *, tp_group: ProcessGroup | None = None, chunk_size: int = 0
) -> Tensor:
    """Per-token entropy of the vocab-sharded softmax, ``[..., V_t] -> [...]`` fp32 (no grad)."""
    lead = logits.shape[:-1]
    x = logits.reshape(-1, logits.shape[-1])
    n = x.shape[0]
    step = chunk_size if chunk_size > 0 else max(n, 1)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        out[a:b] = _local_entropy(x[a:b].float(), tp_group)
    _all_reduce(out, dist.ReduceOp.SUM, tp_group)
    return out.reshape(lead)
