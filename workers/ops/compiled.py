"""One way to compile an elementwise or row-wise op for packed batches: ``token_dynamic``.

The engine compiles a few small functions (the rotation, the q/k norm with it, RMSNorm, the
fused head's passes) rather than whole layers. Each is compiled once for every pack size: only
dim 0 of every tensor argument (the token, or row, dimension) is dynamic, so heads, head dim,
width and vocabulary stay constants of the kernel. Everything dynamic made each element's index
a division by a runtime value: on an H200 the rotation ran at ~0.9 TB/s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

RECOMPILE_LIMIT = 64
"""Graphs a compiled function may hold (torch's default is 8; see ``token_dynamic``)."""


def token_dynamic(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` through torch.compile with only the token dimension (dim 0 of every tensor
    argument) dynamic: one graph for every pack size."""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args: Any) -> Tensor:
        # Each function compiles once per (dtype, heads, strides, grad mode, eps) it meets: q and
        # k differ in heads and strides, training and log-prob passes in grad mode, a process
        # with two models in dtype and eps. torch's default of 8 graphs per function is too few.
        # dynamo's settings are per thread (a rank runs its step in a worker thread): set here.
        config = torch._dynamo.config
        if config.recompile_limit < RECOMPILE_LIMIT:
            config.recompile_limit = RECOMPILE_LIMIT
        for a in args:
            if isinstance(a, Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    return call
