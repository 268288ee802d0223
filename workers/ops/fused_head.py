"""The LM head fused with the vocab-parallel log-prob: logits only ever exist one chunk of
tokens at a time, in the GEMM's dtype (docs/algorithms.md §3).

Unfused, the output layer writes ``[tokens, V_t]`` logits (``V_t`` = this TP rank's vocabulary
slice), the log-prob kernel reads them, and backward holds their gradient of the same size:
at 32K tokens and Qwen's 151,936-word vocabulary that is 20 GB in fp32 each. Here forward and
backward walk the tokens in chunks of ``chunk`` rows and recompute each chunk's logits
``h W^T`` from the hidden states into one reused buffer, so the peak is ``O(chunk x V_t)``
whatever the length:

    forward   per chunk: logits (bf16 under mixed precision), the target's logit, the row max
              (reduced over TP), the sum of exponentials (reduced over TP), the target's
              log-prob; keeps only ``m`` and ``log_se`` ``[M]`` besides the inputs
    backward  per chunk: logits again, then ``dlogits = g * (onehot - softmax)`` written over
              them (the same operations as ``ops/logprob.py``), then ``dh[rows] += dlogits W``
              and ``dW += dlogits^T h`` into one fp32 buffer each; ``dh`` is summed over TP
              (each rank saw only its vocabulary slice), as megatron's column-parallel output
              layer does - unless the caller sums it itself (``reduce_hidden_grad=False``:
              under sequence parallelism the all-gather that made ``hidden`` reduce-scatters
              ``dh`` in its own backward, which sums it and keeps this rank's tokens).

The three passes over a chunk (max, sum of exponentials, gradient) are ``head_kernels``': on
CUDA each is one compiled kernel that reads the bf16 chunk once and computes in fp32, so a
1,024-token chunk costs about 4 fp32 ``[chunk, V]`` units of memory traffic, GEMMs included,
instead of the ~23.5 of widening the logits and running one torch op per step. On the CPU the
same math runs as plain torch ops. The log-probs are fp32 either way.

``rows`` maps each output row to the hidden row that predicts it, so one hidden row can serve
several targets (a trie's branch point); ``rows = arange(N)`` is the plain case.

Bit-equal log-probs (eager kernels). A BLAS may compute a row of ``A W^T`` differently
depending on how many rows ``A`` has (measured on CPU: 2 rows differ from 300 at H = 64; 256
rows differ from 2048 at H = 2048). So logits are always computed ``ROW_BLOCK`` rows at a time
from row 0, here and in the unfused ``head_logits``, and chunks are whole blocks: every row
comes out of the same matmul call either way, and the log-probs and entropies are
``torch.equal``. ``dW`` sums the tokens chunk by chunk instead of in one matmul: equal to fp32
rounding (~1e-6 relative). On CUDA a chunk is one matmul and the compiled kernels reduce in
another order: the two paths agree within fp32 rounding there (1e-6 relative on the
log-probs), not bit for bit.

Shapes: ``hidden [N, H]``, ``weight [V_t, H]``, ``target [M]`` int64, ``rows [M]`` int64 ->
log-probs ``[M]`` fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.autograd import apply, apply_pair
from trainctl.workers.ops.head_kernels import kernels_for
from trainctl.workers.ops.logprob import _all_reduce, _local_entropy, _local_target

ROW_BLOCK = 256
"""Rows of logits computed by one matmul (see the module docstring)."""


def head_logits(hidden: Tensor, weight: Tensor, rows: Tensor, out: Tensor | None = None) -> Tensor:
    """Logits ``hidden[rows] @ weight^T`` in the GEMM's dtype (bf16 stays bf16): the unfused
    path (all rows at once, with autograd) and each chunk of the fused one (into ``out`` when
    given: no allocation). On the CPU ``ROW_BLOCK`` rows per matmul from row 0 (see the module
    docstring); on CUDA one matmul, where 256-row blocks would re-read the whole weight per
    block (at Qwen3's 151,936 x 1,024, more bytes than the block's own logits)."""
    h = hidden[rows]
    block = ROW_BLOCK if h.device.type == "cpu" else max(h.shape[0], 1)
    if out is None:
        if block >= h.shape[0]:
            return h @ weight.t()
        out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    direct = not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad))
    for a in range(0, h.shape[0], block):
        if direct:
            torch.matmul(h[a : a + block], weight.t(), out=out[a : a + block])
        else:
            out[a : a + block] = h[a : a + block] @ weight.t()
    return out


def _chunk(chunk_size: int, n: int) -> int:
    """Rows per chunk: whole ``ROW_BLOCK``s (all ``n`` rows when ``chunk_size`` is 0)."""
    if chunk_size <= 0:
        return max(n, 1)
    return -(-chunk_size // ROW_BLOCK) * ROW_BLOCK


def _rows(rows: Tensor | None, target: Tensor) -> Tensor:
    """The row map: each target's hidden row (``arange`` when not given), checked."""
    if rows is None:
        return torch.arange(target.shape[0], device=target.device)
    if rows.shape != target.shape:
        raise ValueError(f"rows {tuple(rows.shape)} and target {tuple(target.shape)} differ")
    return rows


def _buffer(hidden: Tensor, weight: Tensor, rows: int) -> Tensor:
    """One chunk's logits buffer, reused by every chunk of a pass."""
    return torch.empty(rows, weight.shape[0], dtype=hidden.dtype, device=hidden.device)


_ADDMM_FP32: list[bool] = []
"""Whether ``addmm(..., out_dtype=float32)`` ran here (CUDA): tried once per process."""


def _add_weight_grad(dw: Tensor, d: Tensor, h: Tensor) -> None:
    """``dw += d^T h`` with ``dw`` fp32 and ``d``, ``h`` in the weight's dtype: where the GEMM
    can accumulate into fp32 itself (CUDA's ``addmm`` with ``out_dtype``) it does, else the
    product in the operands' dtype is added (as autograd's unfused head does)."""
    if d.dtype == torch.float32:
        dw.addmm_(d.t(), h)
        return
    if d.is_cuda and _ADDMM_FP32 != [False]:
        try:
            torch.addmm(dw, d.t(), h, out_dtype=torch.float32, out=dw)
            _ADDMM_FP32[:] = [True]
            return
        except (RuntimeError, TypeError):
            _ADDMM_FP32[:] = [False]
    dw.add_(d.t() @ h)


class _FusedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        rows: Tensor,
        vocab_start: int,
        tp_group: Any,
        chunk: int,
        reduce_hidden_grad: bool,
    ) -> Tensor:
        n = target.shape[0]
        local, outside = _local_target(target, vocab_start, weight.shape[0])
        m = torch.empty(n, 1, dtype=torch.float32, device=hidden.device)
        log_se = torch.empty(n, 1, dtype=torch.float32, device=hidden.device)
        lp = torch.empty(n, 1, dtype=torch.float32, device=hidden.device)
        buf = _buffer(hidden, weight, min(chunk, n))
        k = kernels_for(hidden)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = head_logits(hidden, weight, rows[a:b], out=buf[: b - a])
            x_t = x.gather(-1, local[a:b].unsqueeze(-1)).float()
            m[a:b] = _all_reduce(k.row_max(x), dist.ReduceOp.MAX, tp_group)
            se = _all_reduce(k.sum_exp_(x, m[a:b]), dist.ReduceOp.SUM, tp_group)
            log_se[a:b] = se.log_()
            # ((x - m) - log_se) at the target, in the order of ops/logprob.py's kernels.
            torch.sub(x_t, m[a:b], out=lp[a:b]).sub_(log_se[a:b])
        out = lp.squeeze(-1).masked_fill_(outside, 0.0)
        _all_reduce(out, dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(hidden, weight, rows, local, outside, m, log_se)
        ctx.chunk, ctx.tp_group, ctx.reduce_hidden_grad = chunk, tp_group, reduce_hidden_grad
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, rows, local, outside, m, log_se = ctx.saved_tensors
        n = rows.shape[0]
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        buf = _buffer(hidden, weight, min(ctx.chunk, n))
        k = kernels_for(hidden)
        g = g.float()
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            x = head_logits(hidden, weight, rows[a:b], out=buf[: b - a])
            # The logits' gradient over the logits, in their dtype: the two matmuls then run
            # in the weight's dtype (fp32 accumulation inside) as autograd's do through the
            # unfused head. Widened operands ran as fp32 GEMMs: on an H200, 36% of a
            # Qwen3-0.6B step at 16K tokens.
            d = k.grad_(x, m[a:b], log_se[a:b], g[a:b], local[a:b], outside[a:b])
            dh.index_add_(0, rows[a:b], (d @ weight).float())
            _add_weight_grad(dw, d, hidden[rows[a:b]])
        if ctx.reduce_hidden_grad:
            _all_reduce(dh, dist.ReduceOp.SUM, ctx.tp_group)
        return dh.to(hidden.dtype), dw.to(weight.dtype), None, None, None, None, None, None


ShareOf = Callable[[Tensor, int, int], Tensor]
"""``share_of(lp, a, b)``: the loss share of output rows ``[a, b)`` from their log-probs
``lp [b - a]`` (differentiable in ``lp``; every other input it reads is a constant)."""


class _FusedHeadLoss(torch.autograd.Function):
    """The head, the log-probs and a per-token separable loss with the head's gradient taken
    in the forward pass: each chunk's logits are used once, for the statistics and then for
    their gradient, so the backward recomputes nothing (Liger-Kernel's fused linear
    cross-entropy, for any loss whose term of a token reads only that token's log-prob)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        rows: Tensor,
        share_of: ShareOf,
        vocab_start: int,
        tp_group: Any,
        chunk: int,
        reduce_hidden_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        n = target.shape[0]
        local, outside = _local_target(target, vocab_start, weight.shape[0])
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        share: Tensor | None = None
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        buf = _buffer(hidden, weight, min(chunk, n))
        k = kernels_for(hidden)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = head_logits(hidden, weight, rows[a:b], out=buf[: b - a])
            x_t = x.gather(-1, local[a:b].unsqueeze(-1)).float()
            m = _all_reduce(k.row_max(x), dist.ReduceOp.MAX, tp_group)
            keeps = k.keeps_logits(x)
            log_se = _all_reduce(k.sum_exp_(x, m), dist.ReduceOp.SUM, tp_group).log_()
            lp_c = torch.sub(x_t, m).sub_(log_se).squeeze(-1).masked_fill_(outside[a:b], 0.0)
            lp[a:b] = _all_reduce(lp_c, dist.ReduceOp.SUM, tp_group)
            with torch.enable_grad():
                lp_in = lp[a:b].clone().requires_grad_()
                part = share_of(lp_in, a, b)
                (g,) = torch.autograd.grad(part, lp_in)
            share = part.detach() if share is None else share + part.detach()
            if not keeps:  # the eager fp32 pass overwrote the chunk: make it again
                x = head_logits(hidden, weight, rows[a:b], out=buf[: b - a])
            d = k.grad_(x, m, log_se, g, local[a:b], outside[a:b])
            dh.index_add_(0, rows[a:b], (d @ weight).float())
            _add_weight_grad(dw, d, hidden[rows[a:b]])
        if reduce_hidden_grad:
            _all_reduce(dh, dist.ReduceOp.SUM, tp_group)
        if share is None:  # no rows: a zero share in the loss's own dtype
            with torch.enable_grad():
                empty = torch.zeros(0, dtype=torch.float32, device=hidden.device)
                share = share_of(empty.requires_grad_(), 0, 0).detach()
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(lp)
        return share, lp

    @staticmethod
    def backward(ctx: Any, g: Tensor, _lp: Tensor | None) -> tuple[Tensor | None, ...]:
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        g = g.float()
        return (dh * g).to(h_dtype), (dw * g).to(w_dtype), *([None] * 7)


def fused_head_loss(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    share_of: ShareOf,
    *,
    rows: Tensor | None = None,
    vocab_start: int = 0,
    tp_group: ProcessGroup | None = None,
    chunk_size: int = 1024,
    reduce_hidden_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(loss share, log-probs)`` of a per-token separable loss over the head: the share is
    ``sum`` over chunks of ``share_of(lp[a:b], a, b)``, and its gradient with respect to
    ``hidden`` and ``weight`` is computed here, in the forward pass (``_FusedHeadLoss``); the
    log-probs (fp32 ``[M]``) carry no gradient. The same numbers as ``fused_head_logprob``
    followed by the loss, within fp32 rounding, with one matmul fewer per chunk."""
    rows = _rows(rows, target)
    chunk = _chunk(chunk_size, int(target.shape[0]))
    return apply_pair(
        _FusedHeadLoss,
        hidden,
        weight,
        target,
        rows,
        share_of,
        vocab_start,
        tp_group,
        chunk,
        reduce_hidden_grad,
    )


def fused_head_logprob(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    rows: Tensor | None = None,
    vocab_start: int = 0,
    tp_group: ProcessGroup | None = None,
    chunk_size: int = 1024,
    reduce_hidden_grad: bool = True,
) -> Tensor:
    """Per-target log p(target) of the logits ``hidden[rows] @ weight^T`` (vocab-sharded over
    ``tp_group``), never holding more than ``chunk_size`` rows of logits (rounded up to whole
    ``ROW_BLOCK``s; 0 = all at once); fp32 ``[M]``. ``reduce_hidden_grad``: sum the gradient
    of ``hidden`` over ``tp_group`` here (False when the caller's own collective does)."""
    rows = _rows(rows, target)
    chunk = _chunk(chunk_size, int(target.shape[0]))
    return apply(
        _FusedHeadLogprob,
        hidden,
        weight,
        target,
        rows,
        vocab_start,
        tp_group,
        chunk,
        reduce_hidden_grad,
    )


@torch.no_grad()
def fused_head_entropy(
    hidden: Tensor,
    weight: Tensor,
    *,
    rows: Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """Per-row entropy of the softmax over ``hidden[rows] @ weight^T``, chunk by chunk (no
    grad); fp32 ``[M]``."""
    if rows is None:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
    n = rows.shape[0]
    step = _chunk(chunk_size, n)
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    buf = _buffer(hidden, weight, min(step, max(n, 1)))
    for a in range(0, n, step):
        b = min(n, a + step)
        x = head_logits(hidden, weight, rows[a:b], out=buf[: b - a])
        out[a:b] = _local_entropy(x.float(), tp_group)
    _all_reduce(out, dist.ReduceOp.SUM, tp_group)
    return out
