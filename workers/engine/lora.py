"""LoRA sites on megatron-core's parallel linears: where adapters live in the model.

Every linear an adapter may touch gets two extra parameters, ``lora_a`` ``[R, in]`` and
``lora_b`` ``[out, R]`` (split over TP as ``workers/ops/lora.py`` says), sized for the
service's largest rank ``R``. An adapter of rank ``r <= R`` uses the first ``r`` rows of ``A``
and columns of ``B``; the rest stay zero, and stay zero under training (their gradients are
exactly zero), so a padded adapter computes what an ``r``-wide one does. Sites an adapter does
not target are switched off and add nothing.

The sites (Tinker's ``train_attn``, ``train_mlp``, ``train_unembed``):
    attn     ``self_attention.linear_qkv`` (column) and ``self_attention.linear_proj`` (row)
    mlp      ``mlp.linear_fc1`` (column, gate and up rows share ``A``) and ``mlp.linear_fc2``
             (row); on an MoE model each expert's ``linear_fc1`` and ``linear_fc2``, whole
             on the expert's rank (``grouped_delta``): both factors are reduced over the
             expert-data-parallel group, as the experts' weights are
    unembed  ``output_layer`` (column over the vocabulary): our LM head runs inside the
             log-prob kernel, so it takes the merged weight ``W + s B A`` (``lm_head_weight``)

The base weights are frozen before megatron's DDP wraps the model, so gradients, their
buffers and the optimizer's state exist for the adapter's parameters only.
"""

from __future__ import annotations

import functools
import math
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from trainctl.workers.ops.lora import (
    column_parallel_delta,
    grouped_delta,
    merged_weight,
    row_parallel_delta,
)

TARGET_GROUPS = ("attn", "mlp", "unembed")
_SITES = {
    "self_attention.linear_qkv": ("attn", "column"),
    "self_attention.linear_proj": ("attn", "row"),
    "mlp.linear_fc1": ("mlp", "column"),
    "mlp.linear_fc2": ("mlp", "row"),
}
ROW_PARALLEL = ("linear_proj", "linear_fc2")
"""Row-parallel sites: ``A`` is split on its input columns, ``B`` replicated."""


def is_lora(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


@dataclass(frozen=True)
class ActiveAdapter:
    """What the sites compute with: the scaling, the dropout, the groups switched on."""

    scaling: float = 0.0
    dropout: float = 0.0
    groups: frozenset[str] = frozenset()


@dataclass
class Site:
    """One adapted linear of this rank's model, and the adapter it computes with."""

    name: str
    """The module's local name (``decoder.layers.0.self_attention.linear_qkv``, ...)."""
    group: str
    """``attn``, ``mlp`` or ``unembed``."""
    a: nn.Parameter
    b: nn.Parameter
    kind: str
    """``column``, ``row`` or ``expert``."""
    tp_group: ProcessGroup | None
    sequence_parallel: bool
    active: ActiveAdapter = field(default_factory=ActiveAdapter)

    @property
    def on(self) -> bool:
        return self.group in self.active.groups


_HEADS: weakref.WeakKeyDictionary[nn.Module, Site] = weakref.WeakKeyDictionary()
"""Model chunk -> its LM head's site (the last stage's chunk only)."""


def attach(
    model: nn.Module,
    *,
    max_rank: int,
    tp_group: ProcessGroup | None,
    sequence_parallel: bool,
    head_weight_shape: tuple[int, ...] | None,
) -> list[Site]:
    """Add ``lora_a``/``lora_b`` (zeros) to every site of ``model`` and route its forward
    through the adapter; ``head_weight_shape``: this rank's LM-head weight shape on the last
    stage (None elsewhere). Returns the sites, all switched off."""
    sites: list[Site] = []
    for name, module in model.named_modules():
        suffix = next((s for s in _SITES if name.endswith("." + s)), None)
        if suffix is None:
            continue
        group, kind = _SITES[suffix]
        weight: Tensor = module.weight
        a, b = _add(module, weight.shape, max_rank, weight.dtype)
        # The TP-replicated factor sees only this rank's tokens under sequence parallelism:
        # megatron's finalize_model_grads sums what is marked so over TP, as for the norms.
        setattr(a if kind == "column" else b, "sequence_parallel", sequence_parallel)
        site = Site(name, group, a, b, kind, tp_group, sequence_parallel)
        module.forward = functools.partial(_forward, site, module.forward)
        sites.append(site)
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts") and hasattr(module, "adapter"):
            sites += _attach_experts(name, module, max_rank)
    if head_weight_shape is not None:
        head = model.output_layer
        assert isinstance(head, nn.Module)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        a, b = _add(head, head_weight_shape, max_rank, dtype)
        _HEADS[model] = Site("output_layer", "unembed", a, b, "column", tp_group, False)
        sites.append(_HEADS[model])
    return sites


def _attach_experts(name: str, experts: Any, max_rank: int) -> list[Site]:
    """Sites on every local expert's ``linear_fc1`` and ``linear_fc2`` (``GroupedExperts``),
    applied to the expert's own rows through ``experts.adapter``."""
    by_linear: dict[str, list[Site]] = {"linear_fc1": [], "linear_fc2": []}
    for i, expert in enumerate(experts.local_experts):
        for linear, sites in by_linear.items():
            holder = getattr(expert, linear)
            weight: Tensor = holder.weight
            a, b = _add(holder, weight.shape, max_rank, weight.dtype)
            for factor in (a, b):
                setattr(factor, "allreduce", False)
            site_name = f"{name}.local_experts.{i}.{linear}"
            sites.append(Site(site_name, "mlp", a, b, "expert", None, False))
    experts.adapter = functools.partial(_experts_delta, by_linear)
    return [s for sites in by_linear.values() for s in sites]


def _experts_delta(
    by_linear: dict[str, list[Site]], linear: str, x: Tensor, splits: list[int]
) -> Tensor | None:
    sites = by_linear[linear]
    if not sites[0].on:
        return None
    active = sites[0].active
    return grouped_delta(
        x,
        splits,
        [s.a for s in sites],
        [s.b for s in sites],
        active.scaling,
        dropout=active.dropout,
        training=torch.is_grad_enabled(),
    )


def _add(
    module: nn.Module, weight_shape: tuple[int, ...], max_rank: int, dtype: torch.dtype
) -> tuple[nn.Parameter, nn.Parameter]:
    out_f, in_f = weight_shape
    a = nn.Parameter(torch.zeros((max_rank, in_f), dtype=dtype))
    b = nn.Parameter(torch.zeros((out_f, max_rank), dtype=dtype))
    module.register_parameter("lora_a", a)
    module.register_parameter("lora_b", b)
    return a, b


def _forward(site: Site, base_forward: Any, x: Tensor, *args: Any, **kwargs: Any) -> Any:
    out, bias = base_forward(x, *args, **kwargs)
    if not site.on:
        return out, bias
    delta = column_parallel_delta if site.kind == "column" else row_parallel_delta
    d = delta(
        x,
        site.a,
        site.b,
        site.active.scaling,
        tp_group=site.tp_group,
        sequence_parallel=site.sequence_parallel,
        dropout=site.active.dropout,
        training=torch.is_grad_enabled(),
    )
    return out + d.to(out.dtype), bias


def set_active(sites: list[Site], active: ActiveAdapter) -> None:
    for s in sites:
        s.active = active


def head_weight(model: nn.Module, weight: Tensor) -> Tensor:
    """The LM head's weight with the active adapter folded in (``W + s B A``), or ``weight``
    itself when no adapter targets the unembedding."""
    site = _HEADS.get(model)
    if site is None or not site.on:
        return weight
    return merged_weight(weight, site.a, site.b, site.active.scaling, tp_group=site.tp_group)


def init_a(name: str, shape: tuple[int, ...], *, seed: int, rank: int) -> Tensor:
    """A full (unsharded) ``A`` of an adapter of rank ``rank`` padded to ``shape[0]`` rows:
    PEFT's default (Kaiming-uniform, bound ``1 / sqrt(in)``) drawn from a generator seeded by
    ``(seed, canonical name)``, so an adapter is the same on every layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    a = torch.zeros(shape)
    a[:rank] = (torch.rand((rank, shape[1]), generator=gen) * 2 - 1) * bound
    return a
