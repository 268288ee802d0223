"""The dense SwiGLU MLP, whose product can be recomputed in backward.

megatron-core's ``MLP`` runs fc1, the SwiGLU (``silu(gate) * up``) and fc2; fc2 keeps its
input, the SwiGLU's product, for its weight gradient: ``[tokens, ffn]`` per layer, the
largest tensor a dense layer keeps (6 KB a token in bf16 at Qwen3-0.6B's 3,072), made from
fc1's output by one elementwise op. With ``recompute_product`` the product is made under
megatron's ``CheckpointWithoutOutput``: its storage is emptied once fc2 has used it, and a
gradient hook refills it (one SwiGLU forward, from fc1's output, which the SwiGLU keeps
anyway) before fc2's backward reads it, so the layer keeps fc1's output only.

The SwiGLU is the submodule ``swiglu``: on CUDA megatron's fused kernel
(``bias_swiglu_impl``, as its ``MLP`` runs it under ``bias_activation_fusion``), elsewhere
the eager ops; either way the same arithmetic as megatron's ``MLP``, which is what this
replaces for every dense layer (the recompute or not).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.mlp import MLP
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """``silu(gate) * up`` of fc1's output ``[..., 2 x ffn]`` (gate half first). Owns no
    tensor: only which kernel runs (``fused``: megatron's)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            product: Tensor = bias_swiglu_impl(x, None, False, False)
            return product
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up


class DenseMLP(MLP):  # type: ignore[misc]  # megatron-core ships no types
    """megatron-core's dense ``MLP`` for SwiGLU models, the product recomputable. Owns what
    megatron's does (fc1, fc2), its SwiGLU and whether the product is recomputed."""

    def __init__(self, *args: Any, recompute_product: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not (self.config.gated_linear_unit and self.config.activation_func is F.silu):
            raise ValueError("DenseMLP is SwiGLU's: gated_linear_unit with silu")
        self.swiglu = SwiGLU(fused=self.config.bias_activation_fusion)
        self.recompute_product = recompute_product

    def forward(
        self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        out: Tensor
        out_bias: Tensor | None
        if per_token_scale is not None:  # an expert's weighting: megatron's own path
            out, out_bias = super().forward(hidden_states, per_token_scale, **kwargs)
            return out, out_bias
        fc1, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1 = fc1 + bias
        if not self.recompute_product:
            out, out_bias = self.linear_fc2(self.swiglu(fc1))
            return out, out_bias
        checkpoint = CheckpointWithoutOutput()
        product = checkpoint.checkpoint(self.swiglu, fc1)
        out, out_bias = self.linear_fc2(product)
        checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias
