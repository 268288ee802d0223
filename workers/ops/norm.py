"""RMSNorm's formula, once: the engine's norm modules and the fused q/k norm + rotation
(``workers/ops/rope.py``) both call it.

Plain: ``F.rms_norm`` with the weight (the numbers of ``torch.nn.RMSNorm``). Zero-centred
(Qwen3.5): in fp32, scaled by ``1 + weight``, back to the input's dtype, as Hugging Face's
Qwen3.5 norm computes it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """``x / rms(x) * weight`` (or ``* (1 + weight)``) over the last dimension."""
    if zero_centered:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
        return (y * (1.0 + weight.float())).type_as(x)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
