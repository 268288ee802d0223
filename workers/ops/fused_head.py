"""The LM head fused with the vocab-parallel log-prob: logits only ever exist one chunk of
tokens at a time (docs/algorithms.md §3).

Unfused, the output layer writes ``[tokens, V_t]`` logits (``V_t`` = this TP rank's vocabulary
slice), the log-prob kernel reads them, and backward holds their gradient of the same size:
at 32K tokens and Qwen's 151,936-word vocabulary that is 20 GB in fp32 each. Here forward and
backward walk the tokens in chunks of ``chunk`` rows and recompute each chunk's logits
``h W^T`` from the hidden states, so the peak is ``O(chunk x V_t)`` whatever the length:

    forward   per chunk: logits, their row max and log-sum-exp (reduced over TP), the target's
              log-prob; keeps only ``m`` and ``log_se`` ``[M]`` besides the inputs
    backward  per chunk: logits again, ``dlogits = p * (-g) + g at the target`` (the same
              operations as ``ops/logprob.py``), then ``dh[rows] += dlogits W`` and
              ``dW += dlogits^T h`` into one preallocated fp32 buffer each; ``dh`` is summed
              over TP (each rank saw only its vocabulary slice), as megatron's column-parallel
              output layer does - unless the caller sums it itself (``reduce_hidden_grad=False``:
              under sequence parallelism the all-gather that made ``hidden`` reduce-scatters
              ``dh`` in its own backward, which sums it and keeps this rank's tokens).

``rows`` maps each output row to the hidden row that predicts it, so one hidden row can serve
several targets (a trie's branch point); ``rows = arange(N)`` is the plain case.

Bit-equal log-probs. A BLAS may compute a row of ``A W^T`` differently depending on how many
rows ``A`` has (measured on CPU: 2 rows differ from 300 at H = 64; 256 rows differ from 2048 at
H = 2048). So logits are always computed ``ROW_BLOCK`` rows at a time from row 0, here and in
the unfused ``head_logits``, and chunks are whole blocks: every row comes out of the same
matmul call either way, and the log-probs and entropies are ``torch.equal``. ``dW`` sums the
tokens chunk by chunk instead of in one matmul: equal to fp32 rounding (~1e-6 relative).

Shapes: ``hidden [N, H]``, ``weight [V_t, H]``, ``target [M]`` int64, ``rows [M]`` int64 ->
log-probs ``[M]`` fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.logprob import (
    _all_reduce,
    _grad_rows,
    _local_entropy,
    _local_target,
    _row_sum,
)

ROW_BLOCK = 256
"""Rows of logits computed by one matmul (see the module docstring)."""


def head_logits(hidden: Tensor, weight: Tensor, rows: Tensor) -> Tensor:
    """fp32 logits ``hidden[rows] @ weight^T``, ``ROW_BLOCK`` rows per matmul from row 0: the
    unfused path (all rows at once) and each chunk of the fused one (whole blocks)."""
    h = hidden[rows]
    out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
    # Straight into ``out`` where nothing needs a graph (inside the fused kernel): no
    # temporary block. The unfused path keeps autograd, and bf16 logits are widened.
    direct = h.dtype == torch.float32 and not (
        torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    )
    for a in range(0, h.shape[0], ROW_BLOCK):
        if direct:
            torch.matmul(h[a : a + ROW_BLOCK], weight.t(), out=out[a : a + ROW_BLOCK])
        else:
            out[a : a + ROW_BLOCK] = h[a : a + ROW_BLOCK] @ weight.t()
    return out


def _chunk(chunk_size: int, n: int) -> int:
    """Rows per chunk: whole ``ROW_BLOCK``s (all ``n`` rows when ``chunk_size`` is 0)."""
    if chunk_size <= 0:
        return max(n, 1)
    return -(-chunk_size // ROW_BLOCK) * ROW_BLOCK


class _FusedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
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
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = head_logits(hidden, weight, rows[a:b])
            x_t = x.gather(-1, local[a:b].unsqueeze(-1))
            # ops/logprob.py's row statistics, in place: one chunk of logits is all we hold.
            m[a:b] = _all_reduce(x.max(dim=-1, keepdim=True).values, dist.ReduceOp.MAX, tp_group)
            se = _all_reduce(_row_sum(x.sub_(m[a:b]).exp_()), dist.ReduceOp.SUM, tp_group)
            log_se[a:b] = se.log_()
            # ((x - m) - log_se) at the target, in the order of ops/logprob.py's kernels.
            torch.sub(x_t, m[a:b], out=lp[a:b]).sub_(log_se[a:b])
            del x  # before the next chunk's logits exist: one chunk at a time
        out = lp.squeeze(-1).masked_fill_(outside, 0.0)
        _all_reduce(out, dist.ReduceOp.SUM, tp_group)
        ctx.save_for_backward(hidden, weight, rows, local, outside, m, log_se)
        ctx.chunk, ctx.tp_group, ctx.reduce_hidden_grad = chunk, tp_group, reduce_hidden_grad
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, rows, local, outside, m, log_se = ctx.saved_tensors
        n = rows.shape[0]
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            p = head_logits(hidden, weight, rows[a:b]).sub_(m[a:b]).sub_(log_se[a:b]).exp_()
            d = _grad_rows(p, g[a:b], local[a:b], outside[a:b])
            del p
            if weight.dtype == torch.float32:
                dh.index_add_(0, rows[a:b], d @ weight)
                dw.addmm_(d.t(), hidden[rows[a:b]].float())
            else:
                # Mixed precision: the two matmuls in the weight's dtype (fp32 accumulation
                # inside), each chunk's product summed in fp32, as autograd does through the
                # unfused head. Widening the operands instead ran them as fp32 GEMMs: on an
                # H200, 36% of a Qwen3-0.6B step at 16K tokens.
                d = d.to(weight.dtype)
                dh.index_add_(0, rows[a:b], (d @ weight).float())
                dw.add_(d.t() @ hidden[rows[a:b]].to(weight.dtype))
            del d
        if ctx.reduce_hidden_grad:
            _all_reduce(dh, dist.ReduceOp.SUM, ctx.tp_group)
        return dh.to(hidden.dtype), dw.to(weight.dtype), None, None, None, None, None, None


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
    if rows is None:
        rows = torch.arange(target.shape[0], device=hidden.device)
    if rows.shape != target.shape:
        raise ValueError(f"rows {tuple(rows.shape)} and target {tuple(target.shape)} differ")
    chunk = _chunk(chunk_size, int(target.shape[0]))
    return _FusedHeadLogprob.apply(  # type: ignore[no-any-return]
        hidden, weight, target, rows, vocab_start, tp_group, chunk, reduce_hidden_grad
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
    for a in range(0, n, step):
        b = min(n, a + step)
        out[a:b] = _local_entropy(head_logits(hidden, weight, rows[a:b]), tp_group)
    _all_reduce(out, dist.ReduceOp.SUM, tp_group)
    return out
