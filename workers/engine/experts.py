"""The MoE experts of one rank, all applied in one grouped call (``workers/ops/grouped_linear.py``).

Takes the place of megatron's ``SequentialMLP`` in the MoE layer spec: the same inputs (tokens
sorted by local expert, ``tokens_per_expert``, the router probabilities of each row) and the
same parameter names (``local_experts.<i>.linear_fc1.weight`` = ``[gate; up]``,
``local_experts.<i>.linear_fc2.weight``), so checkpoints, the canonical names and the Hugging
Face tables see no difference. What differs is the mechanism: one grouped linear for fc1 and
one for fc2 over every local expert, whose weight gradients are

* full-shape zeros for an expert that got no tokens, never None, so each parameter's gradient
  hook fires on every rank and DDP's buckets stay in step with the ranks whose experts did get
  tokens;
* accumulated straight into megatron's fp32 ``main_grad`` (``grad_added_to_main_grad``), as
  TransformerEngine's grouped linear does for megatron.

A LoRA adapter on the experts (``workers/engine/lora.py``) adds its per-expert update to each
grouped linear's output through ``adapter``, set when the sites are attached.

With ``recompute_product`` (``recompute: elementwise``) the weighted SwiGLU (``silu(gate) * up *
p``) runs under megatron's ``CheckpointWithoutOutput``, as the dense MLP's product does
(``workers/engine/mlp.py``): what its eager ops keep (``silu(gate)``, its product with ``up``)
is never kept, and fc2's input is emptied once used and made again from fc1's output (kept
anyway) before fc2's backward: three ``[rows, ffn]`` a layer less.

Experts are not tensor-parallel (expert TP = 1), so each weight is whole on every rank. At
tp > 1 sequence parallelism gives each TP rank its own slice of the tokens, which it routes
through its whole copy of the experts: the TP ranks are expert-data-parallel replicas, and
megatron's DDP sums expert gradients over the expert-data-parallel group (DP x CP x TP / EP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from trainctl.workers.ops.grouped_linear import WgradOptions, grouped_linear


class _Weight(nn.Module):
    """Holds one weight under megatron's linear-layer name (``<name>.weight``). Owns that weight."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # megatron's DDP reduces a parameter marked allreduce=False over the expert-data-parallel
        # group (the ranks holding the same experts, TP ranks included) instead of DP x CP.
        setattr(self.weight, "allreduce", False)


class _Expert(nn.Module):
    """One expert's two linears under megatron's names. Owns their weights."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = _Weight(2 * ffn, hidden)
        self.linear_fc2 = _Weight(hidden, ffn)


class GroupedExperts(MegatronModule):  # type: ignore[misc]  # megatron-core ships no types
    """SwiGLU experts ``y_t = p_t * W2_e (silu(G_e x_t) * U_e x_t)``, the rows of each local expert
    ``e`` back to back, ``p_t`` the row's router probability. Owns the local experts' weights and
    their LoRA adapter site, and whether the weighted SwiGLU is recomputed."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Any = None,
        pg_collection: Any = None,
        recompute_product: bool = False,
    ) -> None:
        super().__init__(config=config)
        self.recompute_product = recompute_product
        ffn = config.moe_ffn_hidden_size
        assert ffn is not None
        self.local_experts = nn.ModuleList(
            _Expert(config.hidden_size, ffn) for _ in range(num_local_experts)
        )
        self.adapter: Callable[[str, Tensor, list[int]], Tensor | None] | None = None
        """The active LoRA adapter's update of ``linear_fc1`` or ``linear_fc2`` for these
        rows (None: no adapter on the experts)."""

    def forward(
        self, hidden: Tensor, tokens_per_expert: Tensor, probs: Tensor
    ) -> tuple[Tensor, None]:
        splits = [int(n) for n in tokens_per_expert.tolist()]
        experts = cast(list[_Expert], list(self.local_experts))
        fc1 = [e.linear_fc1.weight for e in experts]
        fc2 = [e.linear_fc2.weight for e in experts]
        # Under megatron's DDP every weight has a main_grad: write the wgrad there directly.
        opts = WgradOptions(fuse_wgrad_accumulation=hasattr(fc1[0], "main_grad"))
        gate_up = self._adapted("linear_fc1", grouped_linear(hidden, splits, fc1, opts=opts),
                                hidden, splits)  # fmt: skip
        # The router's weight scales the rows before fc2: p (W2 h + s B2 A2 h) = fc2 of p h.
        weight = probs.unsqueeze(-1).to(hidden.dtype)
        checkpoint = CheckpointWithoutOutput() if self.recompute_product else None
        inner = (
            _weighted_swiglu(gate_up, weight)
            if checkpoint is None
            else checkpoint.checkpoint(_weighted_swiglu, gate_up, weight)
        )
        out = self._adapted("linear_fc2", grouped_linear(inner, splits, fc2, opts=opts),
                            inner, splits)  # fmt: skip
        if checkpoint is not None:
            checkpoint.discard_output_and_register_recompute(out)
        return out, None

    def _adapted(self, linear: str, out: Tensor, x: Tensor, splits: list[int]) -> Tensor:
        delta = None if self.adapter is None else self.adapter(linear, x, splits)
        return out if delta is None else out + delta.to(out.dtype)


def _weighted_swiglu(gate_up: Tensor, weight: Tensor) -> Tensor:
    """``silu(gate) * up * weight`` of fc1's output ``[rows, 2 x ffn]`` (gate half first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up * weight
