"""Router load of MoE layers: tokens routed to each expert of each layer, over all ranks.

Forward hooks on megatron's routers add up their ``routing_map`` (``[tokens, experts]`` bool)
while a real micro-batch runs (dummies are not counted; pads inside real micro-batches are).
``export`` all-reduces the ``[layers, experts]`` counts over the world - each layer lives on
one pipeline stage, each token on one DP x CP rank (and, under sequence parallelism, on one TP
rank), a trie's shared token once - and resets them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def moe_routers(chunk: nn.Module) -> list[Any]:
    """megatron's ``TopKRouter`` of every MoE layer of ``chunk``, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


class RoutingStats:
    """Per-expert token counts on one shard. Owns the counts and whether they are being taken."""

    def __init__(self, chunks: list[Any], *, num_layers: int, num_experts: int) -> None:
        self.counting = False
        self.counts = torch.zeros(num_layers, max(num_experts, 1), dtype=torch.float64)
        self.enabled = num_experts > 0
        if not self.enabled:
            return
        for chunk in chunks:
            for module in moe_routers(chunk):
                module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, _inputs: Any, outputs: Any) -> None:
        if self.counting:
            _probs, routing_map = outputs
            layer = int(getattr(module, "layer_number")) - 1
            # The counts stay on the host: a few hundred numbers per step.
            self.counts[layer] += routing_map.sum(dim=0).double().cpu()

    def export(self) -> dict[str, float]:
        """``moe_routed:sum`` and ``moe_load_max_over_mean:value`` (1.0 = perfectly even)."""
        if not self.enabled:
            return {}
        counts = self.counts.clone()
        dist.all_reduce(counts)
        self.counts.zero_()
        used = counts[counts.sum(dim=1) > 0]
        imbalance = (used.max(dim=1).values / used.mean(dim=1)).max() if len(used) else 0.0
        return {
            "moe_routed:sum": float(counts.sum()),
            "moe_load_max_over_mean:value": float(imbalance),
        }
