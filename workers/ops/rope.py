"""Rotary position embedding from per-token positions, with its tables built once per
micro-batch.

megatron's unfused rotary (``_apply_rotary_pos_emb_bshd``) takes the cosine and sine of the
frequencies in every call: twice per layer (query and key), 28 times over for a 28-layer model.
Here ``RotaryTables`` holds ``cos`` and ``sin`` in the activations' dtype, made once per
micro-batch, and ``apply_rope`` is the same rotate-half formula in the same order, so its
values equal megatron's bit for bit in eager mode. On CUDA the engine calls the compiled form
(``compiled_rope``): one fused kernel each way instead of about eight, compiled once for every
pack size (the token dimension is dynamic).

Shapes: ``x [t, heads, dim]`` (or ``[s, b, heads, dim]``), ``cos/sin [t, 1, rot_dim]``
(broadcast over the heads) -> like ``x``. ``rot_dim <= dim``: the columns past it pass through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RotaryTables:
    """``cos`` and ``sin`` of one micro-batch's rotary frequencies, in the activations' dtype."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def of(cls, freqs: Tensor, dtype: torch.dtype) -> RotaryTables:
        """From fp32 frequencies ``[t, 1, rot_dim]`` (megatron's cast: ``cos(freqs)`` to
        ``dtype``)."""
        return cls(cos=torch.cos(freqs).to(dtype), sin=torch.sin(freqs).to(dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``rot_dim`` columns of ``x``."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    head, rest = x[..., :rot], x[..., rot:]
    h1, h2 = torch.chunk(head, 2, dim=-1)
    return torch.cat(((head * cos) + (torch.cat((-h2, h1), dim=-1) * sin), rest), dim=-1)


@functools.cache
def compiled_rope() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``apply_rope`` through torch.compile, dynamic in every dimension: one graph for every
    pack size (and one more for its backward)."""
    return torch.compile(apply_rope, dynamic=True, fullgraph=True)  # type: ignore[return-value]
