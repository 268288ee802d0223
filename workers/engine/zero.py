"""ZeRO-1 through megatron's distributed optimizer: the pieces the engine needs around it.

With ``use_distributed_optimizer``, megatron's DDP reduce-scatters each gradient bucket over
DP x CP instead of all-reducing it. Rank ``r`` of ``n`` then holds the summed gradient of the
``r``-th ``1/n`` of every bucket, and only there: the rest of its buffer keeps its own unsummed
gradient. Its optimizer holds fp32 master weights and Adam moments for that ``1/n`` only, and
after the update the new parameters are all-gathered from the owners (docs/algorithms.md §8).

What the engine does with that, here:

* ``owned_grads``: each parameter's slice of the summed gradient that this rank holds (empty
  where it holds none), for the gradient norm from the shards;
* ``update_local`` and ``publish``: megatron's step split in two. The update touches only this
  rank's shard and needs no other rank; ``publish`` is the all-gather. The controller starts
  ``publish`` only once every rank's update succeeded (``workers/control/steps.py``);
* ``gather_grads``: the whole summed gradient on every rank (tests and debugging);
* ``state`` / ``load_state``: this rank's shard of the optimizer (moments, master weights).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from torch import Tensor


def _bucket_groups(chunks: Sequence[Any]) -> Iterator[Any]:
    for c in chunks:
        yield from c.bucket_groups
        yield from c.expert_parallel_bucket_groups


def _owned(group: Any) -> Iterator[tuple[Any, int, int]]:
    """Each bucket of ``group`` with the range ``[lo, hi)`` of its buffer this rank owns (the
    ``r``-th of ``n`` equal parts, as megatron's ``shard_buffer`` cuts it)."""
    n = group.intra_distributed_optimizer_instance_size
    r = group.intra_distributed_optimizer_instance_rank
    for bucket in group.buckets:
        size = bucket.grad_data.numel() // n
        yield bucket, r * size, (r + 1) * size


def owned_grads(chunks: Sequence[Any]) -> dict[Tensor, Tensor]:
    """Parameter -> the flat slice of its ``main_grad`` this rank holds summed over its DP x CP
    group (the expert-data-parallel group for experts); possibly empty."""
    out: dict[Tensor, Tensor] = {}
    for group in _bucket_groups(chunks):
        for bucket, lo, hi in _owned(group):
            for p, (start, end) in bucket.param_to_index.items():
                a, b = max(start, lo), min(end, hi)
                out[p] = p.main_grad.view(-1)[a - start : max(a, b) - start]
    return out


def gather_grads(chunks: Sequence[Any]) -> None:
    """All-gather the summed shards, so every rank's ``main_grad`` holds the whole summed
    gradient (a collective over each bucket's group)."""
    for group in _bucket_groups(chunks):
        for bucket, lo, hi in _owned(group):
            dist.all_gather_into_tensor(
                bucket.grad_data,
                bucket.grad_data[lo:hi].clone(),
                group=group.intra_distributed_optimizer_instance_group,
            )


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def update_local(optimizer: Any) -> None:
    """Adam on this rank's shard, and the new values into this rank's part of the parameter
    buffer: megatron's ``step_with_ready_grads`` without its all-gather. No collective."""
    for o in _optimizers(optimizer):
        MixedPrecisionOptimizer.step_with_ready_grads(o)


@torch.no_grad()
def publish(chunks: Sequence[Any]) -> None:
    """All-gather the updated parameter shards: every rank holds every new parameter."""
    for c in chunks:
        c.start_param_sync(force_sync=True)


def _main_shards(o: Any) -> list[Tensor]:
    return [t for g in (*o.shard_fp32_from_float16_groups, *o.shard_fp32_groups) for t in g]


def state(optimizer: Any) -> list[dict[str, Any]]:
    """This rank's optimizer shard: the inner Adam state (moments, step, hyper-parameters) and
    the fp32 master weights, per chained optimizer."""
    return [
        {
            "adam": o.optimizer.state_dict(),
            "main": [t.detach().clone() for t in _main_shards(o)],
        }
        for o in _optimizers(optimizer)
    ]


@torch.no_grad()
def load_state(optimizer: Any, saved: list[dict[str, Any]]) -> None:
    """Inverse of ``state`` on the same layout (the shards must have the same sizes)."""
    opts = _optimizers(optimizer)
    if len(saved) != len(opts):
        raise ValueError(f"optimizer state of {len(saved)} optimizers, this rank has {len(opts)}")
    for o, s in zip(opts, saved, strict=True):
        mains = _main_shards(o)
        if [t.shape for t in mains] != [t.shape for t in s["main"]]:
            raise ValueError("optimizer shard sizes differ: saved on another layout")
        o.optimizer.load_state_dict(s["adam"])
        for t, v in zip(mains, s["main"], strict=True):
            t.copy_(v)


@torch.no_grad()
def restart(optimizer: Any) -> None:
    """A fresh optimizer over the current model weights (loaded without their optimizer
    state): the fp32 masters copied from the model, Adam's moments and step count dropped
    (torch's Adam starts them anew on its next step). Works for plain and ZeRO optimizers."""
    optimizer.reload_model_params()
    for o in _optimizers(optimizer):
        o.optimizer.state.clear()
