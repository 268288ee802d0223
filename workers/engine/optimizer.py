"""The shard's optimizer part: the global gradient norm, clipping, the AdamW update of what
this rank owns, and ZeRO-1's all-gather of the updated parameters (docs/algorithms.md §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainctl.workers.engine import megatron_cpu, weights, zero
from trainctl.workers.engine.accumulation import Accumulation
from trainctl.workers.engine.boundary import RankCoords
from trainctl.workers.engine.config import EngineConfig, OptimizerConfig
from trainctl.workers.engine.model import set_hyperparameters
from trainctl.workers.engine.parallel import ParallelDims

_CLIP_EPS = 1e-6  # keeps the clip coefficient finite when the gradient norm is ~0
_EMPTY = torch.zeros(0)


class OptimizerPart:
    """Mixed into ``EngineShard``: what it needs of the shard is declared here."""

    cfg: EngineConfig
    coords: RankCoords
    dims: ParallelDims
    chunks: list[Any]
    optimizer: Any
    window: Accumulation
    zero: bool
    device: torch.device
    step: int
    adapters: Any

    if TYPE_CHECKING:

        def _trainable(self) -> list[tuple[str, Any]]: ...

    def update_local(
        self, grad_norm: float | None = None, hyper: OptimizerConfig | None = None
    ) -> float:
        """The optimizer update of what this rank owns (all of it, or its ZeRO shard); no
        collective unless the norm must still be computed. Gradients are zeroed after it.
        ``hyper``: this update's AdamW settings and clip norm (default: the engine config's)."""
        hyper = hyper or self.cfg.optimizer
        set_hyperparameters(self.optimizer, hyper)
        with megatron_cpu.cuda_to_cpu():
            self.optimizer.prepare_grads()
            if grad_norm is None:
                grad_norm = self.grad_norm()
            clip = hyper.clip_grad
            if clip > 0 and grad_norm > clip:
                coeff = clip / (grad_norm + _CLIP_EPS)
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(coeff)
            if self.zero:
                zero.update_local(self.optimizer)
            else:
                self.optimizer.step_with_ready_grads()
        self.zero_grad()
        self.step += 1
        if self.adapters is not None:
            self.adapters.stepped()
        return grad_norm

    def publish(self) -> None:
        """ZeRO-1: all-gather the updated parameter shards (a collective over DP x CP); nothing
        to do without it."""
        if self.zero:
            with megatron_cpu.cuda_to_cpu():
                zero.publish(self.chunks)

    def grad_norm(self) -> float:
        """L2 norm of the full model's gradient: every canonical parameter counted once.

        TP-replicated parameters (norms, routers, experts) count on TP rank 0 only, tied
        embeddings on the first stage only; the sum of squares is then all-reduced over the
        model-parallel group (TP x PP). Without ZeRO, DP x CP replicas already hold the
        synchronised gradient; with it, each rank sums the squares of the slices it holds
        summed (``zero.owned_grads``) and those partial sums are added over DP x CP (over
        expert-DP for experts).
        """
        owned = zero.owned_grads(self.chunks) if self.zero else {}
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self._trainable():
            g = owned.get(p, _EMPTY) if self.zero else p.main_grad
            if ".local_experts." in name:
                experts += g.double().pow(2).sum()
            elif self.coords.tp == 0 or weights.shard_rule(name).kind != "replicated":
                dense += g.double().pow(2).sum()
        if self.zero:
            dist.all_reduce(dense, group=self.dims.dp_cp_group)
            if self.cfg.model.num_experts:
                dist.all_reduce(experts, group=self.dims.expert_dp_group)
        # Each EP rank holds different experts: their squares add up over the EP group too.
        if self.cfg.layout.ep > 1:
            dist.all_reduce(experts, group=self.dims.ep_group)
        # Experts are whole on every TP rank (expert TP = 1): they count on TP rank 0 only.
        sq = dense + (experts if self.coords.tp == 0 else torch.zeros_like(experts))
        dist.all_reduce(sq, group=self.dims.mp_group)
        return float(sq.sqrt())

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.window.clear()
