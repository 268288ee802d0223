"""The fused LM head's three passes over a chunk of logits, in two implementations.

The head (``workers/ops/fused_head.py``) holds one chunk of logits ``x [c, V_t]`` at a time, in
the GEMM's dtype (bf16 under mixed precision: the matmul's own output, never widened). Three
passes read it:

* ``row_max(x)``: the row maximum ``[c, 1]`` fp32 (then all-reduced over TP);
* ``sum_exp_(x, m)``: ``sum(exp(x - m))`` per row ``[c, 1]`` fp32 (then all-reduced);
* ``grad_(x, m, log_se, g, local, outside)``: the logits' gradient
  ``g * (onehot(target) - softmax(x))``, written over ``x`` in its dtype.

``EagerKernels`` is the math in plain torch ops, in the order of ``workers/ops/logprob.py``'s
kernels, so the log-probs equal the unfused path's bit for bit; on bf16 logits it widens each
chunk to fp32 once per pass. ``CompiledKernels`` is the same math compiled (torch.compile:
Triton on CUDA, C++ on CPU): each pass one kernel that reads the bf16 chunk once, computes in
fp32 registers and writes only ``[c, 1]`` (or the gradient over the chunk, in place). Each
compiled pass is a ``trainctl::head_*`` operator, so a dispatch-level counter sees one
operation with its real inputs and outputs.

``kernels_for(x)`` picks: compiled on CUDA, eager elsewhere (a CPU compile costs ~20 s per
process); ``force_kernels`` overrides it (the traffic test, the probe).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from trainctl.workers.ops.compiled import token_dynamic
from trainctl.workers.ops.logprob import _grad_rows, _row_sum


class HeadKernels(Protocol):
    def keeps_logits(self, x: Tensor) -> bool:
        """Whether ``sum_exp_`` leaves ``x`` as it was (else it is overwritten)."""
        ...

    def row_max(self, x: Tensor) -> Tensor: ...

    def sum_exp_(self, x: Tensor, m: Tensor) -> Tensor: ...

    def grad_(
        self, x: Tensor, m: Tensor, log_se: Tensor, g: Tensor, local: Tensor, outside: Tensor
    ) -> Tensor: ...


class EagerKernels:
    """Plain torch ops. ``sum_exp_`` and ``grad_`` overwrite fp32 ``x`` (no second fp32 chunk);
    bf16 ``x`` is widened into one fp32 temporary per pass."""

    name = "eager"

    def keeps_logits(self, x: Tensor) -> bool:
        return x.dtype != torch.float32

    def row_max(self, x: Tensor) -> Tensor:
        return x.max(dim=-1, keepdim=True).values.float()

    def sum_exp_(self, x: Tensor, m: Tensor) -> Tensor:
        z = x.sub_(m) if x.dtype == torch.float32 else x.float().sub_(m)
        return _row_sum(z.exp_())

    def grad_(
        self, x: Tensor, m: Tensor, log_se: Tensor, g: Tensor, local: Tensor, outside: Tensor
    ) -> Tensor:
        p = x if x.dtype == torch.float32 else x.float()
        _grad_rows(p.sub_(m).sub_(log_se).exp_(), g, local, outside)
        return p if p is x else x.copy_(p)


# -- the compiled passes ------------------------------------------------------------------


def _row_max(x: Tensor) -> Tensor:
    return x.amax(dim=-1, keepdim=True).float()


def _sum_exp(x: Tensor, m: Tensor) -> Tensor:
    return torch.exp(x.float() - m).sum(dim=-1, keepdim=True)


def _grad(x: Tensor, m: Tensor, log_se: Tensor, g: Tensor, local: Tensor, outside: Tensor) -> None:
    p = torch.exp((x.float() - m) - log_se)
    cols = torch.arange(x.shape[-1], device=x.device)
    hit = (cols[None, :] == local[:, None]) & ~outside[:, None]
    gc = g[:, None]
    x.copy_(p * (-gc) + torch.where(hit, gc, 0.0))


@functools.cache
def _compiled(name: str) -> Callable[..., Any]:
    """A pass compiled with only its row dimension dynamic: the vocabulary slice stays a
    constant of the kernel, so a column index is no division by a runtime value."""
    passes: dict[str, Callable[..., Any]] = {
        "row_max": _row_max,
        "sum_exp": _sum_exp,
        "grad": _grad,
    }
    return token_dynamic(passes[name])


@torch.library.custom_op("trainctl::head_row_max", mutates_args=())
def _head_row_max(x: Tensor) -> Tensor:
    out: Tensor = _compiled("row_max")(x)
    return out


@torch.library.custom_op("trainctl::head_sum_exp", mutates_args=())
def _head_sum_exp(x: Tensor, m: Tensor) -> Tensor:
    out: Tensor = _compiled("sum_exp")(x, m)
    return out


@torch.library.custom_op("trainctl::head_grad_", mutates_args=("x",))
def _head_grad_(
    x: Tensor, m: Tensor, log_se: Tensor, g: Tensor, local: Tensor, outside: Tensor
) -> None:
    _compiled("grad")(x, m, log_se, g, local, outside)


class CompiledKernels:
    """One compiled kernel per pass, each a ``trainctl::head_*`` operator."""

    name = "compiled"

    def keeps_logits(self, x: Tensor) -> bool:
        return True

    def row_max(self, x: Tensor) -> Tensor:
        out: Tensor = _head_row_max(x)
        return out

    def sum_exp_(self, x: Tensor, m: Tensor) -> Tensor:
        out: Tensor = _head_sum_exp(x, m)
        return out

    def grad_(
        self, x: Tensor, m: Tensor, log_se: Tensor, g: Tensor, local: Tensor, outside: Tensor
    ) -> Tensor:
        _head_grad_(x, m, log_se, g, local, outside)
        return x


EAGER = EagerKernels()
COMPILED = CompiledKernels()
_forced: list[HeadKernels] = []


def kernels_for(x: Tensor) -> HeadKernels:
    """Compiled on CUDA, eager elsewhere, unless ``force_kernels`` said otherwise."""
    if _forced:
        return _forced[-1]
    return COMPILED if x.is_cuda else EAGER


def force_kernels(kernels: HeadKernels | None) -> None:
    """Use ``kernels`` everywhere from now on (None: back to ``kernels_for``'s choice)."""
    _forced.clear()
    if kernels is not None:
        _forced.append(kernels)
