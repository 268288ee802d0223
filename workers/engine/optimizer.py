"""The shard's optimizer: the global gradient norm, clipping, the AdamW update of what
this rank owns, and ZeRO-1's all-gather of the updated parameters (docs/algorithms.md §5).

The arithmetic is ``optim_phase``'s: fused AdamW, the norm from one multi-tensor kernel over
the views a ``NormPlan`` holds, the clip coefficient on the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainctl.workers.engine import megatron_cpu, weights, zero
from trainctl.workers.engine.accumulation import Accumulation
from trainctl.workers.engine.adapter_bank import AdapterBank
from trainctl.workers.engine.config import OptimizerConfig
from trainctl.workers.engine.model import set_hyperparameters
from trainctl.workers.engine.optim_phase import NormPlan, clip_
from trainctl.workers.engine.parallel import ShardContext


class ShardOptimizer:
    """Owns this rank's optimizer state and its step count: megatron's optimizer over the
    shard's model chunks, the ``NormPlan`` of the trainable gradients, and the update. It reads
    the shard's chunks, groups and gradient window; ``trainable`` says which parameters train
    now (all of them, or the active adapter's on a frozen base), ``adapters`` is told of every
    step."""

    def __init__(
        self,
        ctx: ShardContext,
        *,
        optimizer: Any,
        window: Accumulation,
        device: torch.device,
        trainable: Callable[[], list[tuple[str, Any]]],
        adapters: AdapterBank | None = None,
    ) -> None:
        self.cfg, self.coords, self.dims, self.chunks = ctx.cfg, ctx.coords, ctx.dims, ctx.chunks
        self.optimizer = optimizer
        self.window = window
        self.device = device
        self.zero = ctx.cfg.use_distributed_optimizer
        self.trainable = trainable
        self.adapters = adapters
        self.step = 0
        """Optimizer steps applied (the base's; an adapter's are its slot's)."""
        self._norm_plan: NormPlan | None = None

    def update_local(
        self, grad_norm: Tensor | None = None, hyper: OptimizerConfig | None = None
    ) -> float:
        """The optimizer update of what this rank owns (all of it, or its ZeRO shard); no
        collective unless the norm must still be computed. Gradients are zeroed after it.
        ``hyper``: this update's AdamW settings and clip norm (default: the engine config's).
        The clip is decided on the device; the norm is read by the host after the update."""
        hyper = hyper or self.cfg.optimizer
        set_hyperparameters(self.optimizer, hyper)
        with megatron_cpu.cuda_to_cpu():
            self.optimizer.prepare_grads()
            if grad_norm is None:
                grad_norm = self.grad_norm()
            clip_(self._grad_buffers(), grad_norm, hyper.clip_grad)
            if self.zero:
                zero.update_local(self.optimizer)
            else:
                self.optimizer.step_with_ready_grads()
        self.zero_grad()
        self.step += 1
        if self.adapters is not None:
            self.adapters.stepped()
        return float(grad_norm)

    def publish(self) -> None:
        """ZeRO-1: all-gather the updated parameter shards (a collective over DP x CP); nothing
        to do without it."""
        if self.zero:
            with megatron_cpu.cuda_to_cpu():
                zero.publish(self.chunks)

    def _grad_buffers(self) -> list[Tensor]:
        """The contiguous fp32 gradient buffers (every trainable parameter's ``main_grad`` is a
        view into one of them)."""
        return [b.grad_data for c in self.chunks for b in (*c.buffers, *c.expert_parallel_buffers)]

    def _plan_norm(self) -> NormPlan:
        """The ``NormPlan`` of the current trainable parameters (cached until they change).

        TP-replicated dense parameters (norms, routers) count on TP rank 0 only, tied
        embeddings on the first stage only (the last stage's copy is not among them); experts
        are summed on every rank and added on TP rank 0 (``grad_norm``). Without ZeRO a
        parameter's view is its whole ``main_grad``; with it, the slice of it this rank holds
        summed (``zero.owned_grads``: possibly empty)."""
        trainable = self.trainable()
        key = tuple(id(p) for _, p in trainable)
        plan = self._norm_plan
        if plan is not None and plan.key == key:
            return plan
        owned = zero.owned_grads(self.chunks) if self.zero else {}
        grads = [owned.get(p) if self.zero else p.main_grad for _, p in trainable]

        def kind(name: str) -> str:
            if ".local_experts." in name:
                return "experts"  # on every TP rank here; counted once after the EP sum
            if self.coords.tp == 0 or weights.shard_rule(name).kind != "replicated":
                return "dense"
            return "none"

        pairs = [(g, kind(n)) for (n, _), g in zip(trainable, grads, strict=True)]
        self._norm_plan = NormPlan.build(pairs, self.device, key=key)
        return self._norm_plan

    def grad_norm(self) -> Tensor:
        """L2 norm of the full model's gradient, every canonical parameter counted once: a
        device scalar (fp64), the same on every rank.

        Each rank sums the squares of the views its ``NormPlan`` holds; the sums are then
        all-reduced: with ZeRO over DP x CP (over expert-DP for experts), experts over EP (each
        EP rank holds other experts), and everything over the model-parallel group (TP x PP).
        """
        dense, experts = self._plan_norm().squares()
        if self.zero:
            _all_reduce(dense, self.dims.dp_cp_group)
            if self.cfg.model.num_experts:
                _all_reduce(experts, self.dims.expert_dp_group)
        if self.cfg.layout.ep > 1:
            _all_reduce(experts, self.dims.ep_group)
        # Experts are whole on every TP rank (expert TP = 1): they count on TP rank 0 only.
        sq = dense + experts if self.coords.tp == 0 else dense
        _all_reduce(sq, self.dims.mp_group)
        return sq.sqrt()

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.window.clear()


def _all_reduce(x: Tensor, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
