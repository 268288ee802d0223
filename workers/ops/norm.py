"""RMSNorm's formula, once: the engine's norm modules and the fused q/k norm + rotation
(``workers/ops/rope.py``) both call it.

Plain: ``F.rms_norm`` with the weight (the numbers of ``torch.nn.RMSNorm``). Zero-centred
(Qwen3.5): in fp32, scaled by ``1 + weight``, back to the input's dtype, as Hugging Face's
Qwen3.5 norm computes it.

``compiled_rms_norm`` is the same function through torch.compile (``token_dynamic``). Eager
CUDA's backward sums the weight's gradient over every token in one reduction kernel, which an
H200 profile of a 32K-token step showed at 0.5-1 TB/s (~31 ms of a 420 ms step); inductor
splits that reduction across the tokens and finishes it in a second small kernel. The engine
uses it where ``EngineConfig.norm_kernel`` resolves to ``compiled`` (by default on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from trainctl.workers.ops.compiled import token_dynamic


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """``x / rms(x) * weight`` (or ``* (1 + weight)``) over the last dimension."""
    if zero_centered:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        return (y * (1.0 + weight.float())).type_as(x)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.cache
def compiled_rms_norm() -> Callable[..., Tensor]:
    """``rms_norm`` compiled, dynamic in the token dimension only (``token_dynamic``)."""
    return token_dynamic(rms_norm)
