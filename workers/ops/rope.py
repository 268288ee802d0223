"""Rotary position embedding from per-token positions, with its tables built once per
micro-batch.

megatron's unfused rotary (``_apply_rotary_pos_emb_bshd``) takes the cosine and sine of the
frequencies in every call: twice per layer (query and key), 28 times over for a 28-layer model.
Here ``RotaryTables`` holds ``cos`` and ``sin`` in the activations' dtype, made once per
micro-batch, and ``apply_rope`` is the same rotate-half formula in the same order, so its
values equal megatron's bit for bit in eager mode. On CUDA the engine calls the compiled form
(``compiled_rope``): one fused kernel each way instead of about eight, compiled once for every
pack size (the token dimension is dynamic). With Qwen3's q/k norms, ``norm_rope`` is the norm and
the rotation together (``compiled_norm_rope`` on CUDA): the core attention applies both.

Shapes: ``x [t, heads, dim]`` (or ``[s, b, heads, dim]``), ``cos/sin [t, 1, rot_dim]``
(broadcast over the heads) -> like ``x``. ``rot_dim <= dim``: the columns past it pass through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainctl.workers.ops.compiled import token_dynamic
from trainctl.workers.ops.norm import rms_norm


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
    """``apply_rope`` compiled, dynamic in the token dimension only (``token_dynamic``)."""
    return token_dynamic(apply_rope)


def norm_rope(
    x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, zero_centered: bool = False
) -> Tensor:
    """Qwen3's q/k norm then the rotation: ``apply_rope(rms_norm(x, weight), cos, sin)``."""
    return apply_rope(rms_norm(x, weight, eps, zero_centered), cos, sin)


@functools.cache
def compiled_norm_rope() -> Callable[..., Tensor]:
    """``norm_rope`` compiled (``token_dynamic``): the norm and the rotation in one kernel each
    way, where eager runs the norm's and the rotation's apart."""
    return token_dynamic(norm_rope)


_forced: list[bool] = []


def force_compiled(on: bool | None) -> None:
    """Use the compiled forms everywhere (True), the eager ones everywhere (False), or pick by
    device again (None: compiled on CUDA). For checks on the CPU."""
    _forced.clear()
    if on is not None:
        _forced.append(on)


def rotation_for(x: Tensor) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """``(rope, norm_rope)`` for ``x``: compiled on CUDA, eager elsewhere (``force_compiled``)."""
    if _forced[-1] if _forced else x.is_cuda:
        return compiled_rope(), compiled_norm_rope()
    return apply_rope, norm_rope
