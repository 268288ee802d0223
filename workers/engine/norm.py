"""RMSNorm for megatron-core's layer spec, usable under sequence parallelism.

megatron-core's local spec builds its norms through ``WrappedTorchNorm``, which refuses a
config with ``sequence_parallel`` (its constructor asserts it off), and the alternative,
apex's fused norm, needs CUDA. This module is the same computation as ``torch.nn.RMSNorm``
(``F.rms_norm``, so the numbers are bit for bit those of the norms it replaces) and takes
megatron's norm arguments, so it slots into every norm of the spec: each layer's input and
pre-MLP norms, the final norm, and Qwen3's q/k norms. Zero-centred (Qwen3.5,
``layernorm_zero_centered_gamma``), it scales by ``1 + weight`` and its weight starts at 0.

Under sequence parallelism each TP rank normalises only its slice of the tokens, so its weight
gradient is a partial sum. The weight is marked ``sequence_parallel`` and megatron's
``finalize_model_grads`` sums those gradients over the TP group (q/k norms are summed by name
there in any case: each TP rank holds other heads).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from trainctl.workers.ops.norm import compiled_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, ``hidden_size`` wide. Owns the weight."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered: bool | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.zero_centered = (
            config.layernorm_zero_centered_gamma if zero_centered is None else zero_centered
        )
        self.weight = nn.Parameter(
            torch.zeros(hidden_size) if self.zero_centered else torch.ones(hidden_size)
        )
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.compiled = False
        """Run ``compiled_rms_norm`` (``EngineConfig.norm_kernel``: ``build_gpt`` sets it)."""

    def forward(self, x: Tensor) -> Tensor:
        norm = compiled_rms_norm() if self.compiled else rms_norm
        return norm(x, self.weight, self.eps, self.zero_centered)


class DeferredRMSNorm(RMSNorm):
    """A q/k norm whose application the core attention takes over, fused with the rotation
    that follows it (``workers/engine/attention.py``): in megatron's place, right after the
    q/k/v projection, it passes its input through. Its parameter keeps its name and place
    (``self_attention.q_layernorm.weight``), so checkpoints and the Hugging Face mapping do not
    change."""

    def forward(self, x: Tensor) -> Tensor:
        return x
