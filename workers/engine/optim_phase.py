"""The optimizer phase as a few fused launches: torch's fused AdamW under megatron's optimizer,
the global gradient norm from one multi-tensor kernel, and clipping on the device.

Without TransformerEngine or apex, megatron-core falls back to ``torch.optim.AdamW`` in its
foreach form and copies the fp32 master weights into the bf16 parameters one tensor at a time;
a plain norm over ~300 tensors in fp64 is ~900 launches, and a clip decided on the host needs
the norm there first (a device sync). Here:

* ``use_fused_adamw``: every inner AdamW runs torch's fused kernel (``fused=True``, CUDA and
  CPU), and keeps doing so after a ``load_state_dict`` (which restores the saved flags, and
  leaves a foreach checkpoint's step counters on the host); the master-to-model copy is one
  ``_foreach_copy_``.
* ``NormPlan``: the gradient views that count toward the global norm, built once for a set of
  trainable parameters, each weighted dense or expert (the engine's counting rules decide which
  and whether). ``NormPlan.squares`` is a handful of dispatched ops whatever the parameter
  count: one ``_foreach_norm``, a stack, a square and two weighted sums.
* ``clip_``: ``min(1, clip / (norm + eps))`` (exactly 1 when the norm is within the bound)
  times every gradient buffer, one ``_foreach_mul_`` with a device scalar: the host never
  looks at the norm before the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CLIP_EPS = 1e-6
"""Keeps the clip coefficient finite when the gradient norm is ~0."""


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers under ``optimizer`` (a chained one holds several)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _fused_flags(opt: torch.optim.Optimizer) -> None:
    opt.defaults.update(fused=True, foreach=False)
    for group in opt.param_groups:
        group["fused"], group["foreach"] = True, False
    for state in opt.state.values():
        # A foreach (or older) checkpoint keeps the step counter on the host as a 0-d tensor;
        # the fused kernel wants it on the parameter's device, in fp32.
        step = state.get("step")
        if isinstance(step, Tensor) and state.get("exp_avg") is not None:
            device = state["exp_avg"].device
            if step.device != device or step.dtype != torch.float32:
                state["step"] = step.to(device=device, dtype=torch.float32)


def use_fused_adamw(optimizer: Any) -> None:
    """Switch every inner ``torch.optim.AdamW`` of megatron's ``optimizer`` to the fused kernel
    for good: now, and after each ``load_state_dict`` (a post-hook); and copy the fp32 masters
    into the bf16 parameters with one multi-tensor copy."""
    for o in inner_optimizers(optimizer):
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        _fused_flags(inner)
        inner.register_load_state_dict_post_hook(_fused_flags)
        if hasattr(o, "_get_model_and_main_params_data_float16") and not hasattr(
            o, "model_param_gbuf_map"
        ):  # the bf16 optimizer, not the distributed one (which copies into its buffer)
            o._copy_main_params_to_model_params = _foreach_copy(o)


def _foreach_copy(o: Any) -> Callable[[], None]:
    def copy_main_to_model() -> None:
        model, main = o._get_model_and_main_params_data_float16()
        if model:
            torch._foreach_copy_(model, main)

    return copy_main_to_model


@dataclass(frozen=True)
class NormPlan:
    """The gradient tensors whose squares make the global norm on this rank, and which of them
    are experts (summed over other groups than the dense ones)."""

    views: list[Tensor]
    dense: Tensor
    """``[len(views)]`` fp64: 1 where the view is a dense parameter's, else 0."""
    experts: Tensor
    """``[len(views)]`` fp64: 1 where the view is an expert's, else 0."""
    key: tuple[int, ...]
    """What it was built for (the trainable parameters' ``id``s): rebuilt when they change."""

    @classmethod
    def build(
        cls, grads: Iterable[tuple[Tensor | None, str]], device: torch.device, key: tuple[int, ...]
    ) -> NormPlan:
        """From ``(gradient view, "dense" | "experts" | "none")``; "none" and empty or missing
        views do not count here (a replicated parameter on another TP rank, a ZeRO slice this
        rank does not hold). ``key``: what the caller rebuilds it on."""
        views, kinds = [], []
        for g, kind in grads:
            if kind == "none" or g is None or g.numel() == 0:
                continue
            views.append(g)
            kinds.append(kind)
        dense = torch.tensor([k == "dense" for k in kinds], dtype=torch.float64, device=device)
        experts = torch.tensor([k == "experts" for k in kinds], dtype=torch.float64, device=device)
        return cls(views=views, dense=dense, experts=experts, key=key)

    def squares(self) -> tuple[Tensor, Tensor]:
        """``(dense, experts)``: the sums of squares this rank holds, fp64 device scalars."""
        if not self.views:
            zero = self.dense.new_zeros(())
            return zero, zero.clone()
        sq = torch.stack(torch._foreach_norm(self.views)).double().square()
        return sq @ self.dense, sq @ self.experts


def clip_(buffers: Sequence[Tensor], norm: Tensor, max_norm: float) -> None:
    """Scale the gradients in ``buffers`` by ``clip / (norm + eps)`` where ``norm > clip`` (a
    device-side choice), else leave them be (times exactly 1)."""
    if max_norm <= 0 or not buffers:
        return
    coeff = torch.where(norm > max_norm, max_norm / (norm + CLIP_EPS), torch.ones_like(norm))
    torch._foreach_mul_(list(buffers), coeff.to(buffers[0].dtype))
