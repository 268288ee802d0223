"""Context-parallel split of packed sequences: the zigzag layout (docs/algorithms.md §1.1-§1.4).

Every packed sequence ``i`` is padded to a length ``L_i`` that is a multiple of ``2c`` and cut
into ``2c`` chunks of ``H_i = L_i / 2c`` tokens. CP rank ``r`` keeps chunk ``r`` followed by
chunk ``2c-1-r`` of every sequence: one early and one late chunk, which balances the cost of
causal attention. The local buffer is ``sum(L_i) / c`` long and the local boundaries are
``padded_cu_seqlens // c`` (exact, since every ``L_i`` is a multiple of ``2c``).

Everything token-aligned (tokens, labels, loss mask and every per-token loss input) is rolled on
the *global* packed sequence first and then split with the same map: after the split a local
neighbour is no longer the next token (docs/algorithms.md §1.4).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.autograd import apply


def zigzag_positions(padded_cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions held by ``cp_rank``, in local order: ``[T / cp_size]`` int64."""
    cu = padded_cu_seqlens.tolist()
    c2 = 2 * cp_size
    parts = []
    for start, end in itertools.pairwise(cu):
        length = end - start
        if length % c2:
            raise ValueError(
                f"sequence at [{start}, {end}) has padded length {length}, "
                f"not a multiple of 2 * cp_size = {c2}"
            )
        h = length // c2
        parts.append(torch.arange(start + cp_rank * h, start + (cp_rank + 1) * h))
        late = c2 - 1 - cp_rank
        parts.append(torch.arange(start + late * h, start + (late + 1) * h))
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts)


def zigzag_inverse(padded_cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """For each global position, its index in the concatenation of all ranks' local buffers.

    ``global = torch.cat(locals)[zigzag_inverse(...)]`` undoes the split (``[T]`` int64).
    """
    total = int(padded_cu_seqlens[-1])
    t_loc = total // cp_size
    inverse = torch.empty(total, dtype=torch.long)
    for r in range(cp_size):
        pos = zigzag_positions(padded_cu_seqlens, cp_size, r)
        inverse[pos] = r * t_loc + torch.arange(pos.numel())
    return inverse


@dataclass(frozen=True, kw_only=True)
class CPShard:
    """What CP rank ``cp_rank`` holds of a micro-batch: every per-token tensor cut by one map."""

    cp_rank: int
    cp_size: int
    per_token: dict[str, Tensor]  # the same names as given, each [T / cp_size]
    local_cu_seqlens: Tensor  # [B+1] int32, boundaries in the local buffer
    global_cu_seqlens: Tensor  # [B+1] int32, what context-parallel attention needs
    positions: Tensor  # [T / cp_size] int64, the global position of each local token


def split_for_cp(
    per_token: Mapping[str, Tensor], cu_seqlens: Tensor, *, cp_size: int, cp_rank: int
) -> CPShard:
    """Cut every ``[T, ...]`` tensor of ``per_token`` with the zigzag map of ``cp_rank``.

    ``cu_seqlens`` are the padded boundaries of the packed sequences (every length a multiple
    of ``2 * cp_size``). The tensors' names mean nothing here: any per-token field is split
    the same way.
    """
    pos = zigzag_positions(cu_seqlens, cp_size, cp_rank)
    return CPShard(
        cp_rank=cp_rank,
        cp_size=cp_size,
        per_token={name: t[pos] for name, t in per_token.items()},
        local_cu_seqlens=(cu_seqlens // cp_size).to(cu_seqlens.dtype),
        global_cu_seqlens=cu_seqlens,
        positions=pos,
    )


def reassemble(locals_by_rank: list[Tensor], padded_cu_seqlens: Tensor) -> Tensor:
    """Put per-rank local tensors ``[T/c, ...]`` back in global order ``[T, ...]``."""
    inverse = zigzag_inverse(padded_cu_seqlens, len(locals_by_rank))
    return torch.cat(locals_by_rank)[inverse]


class _GatherFromCP(torch.autograd.Function):
    """All-gather ``[T/c]`` per-token values over CP into global order ``[T]``.

    Backward: all-reduce the full gradient over CP, then keep this rank's slice. If every CP
    rank computes the same full loss, the gradient arrives ``c`` times (normalise by ``c * N``,
    docs/algorithms.md §1.5, the gathering design). Works on gloo, which has no reduce-scatter.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, inverse: Tensor, cp_group: ProcessGroup) -> Tensor:
        c = dist.get_world_size(cp_group)
        parts = [torch.empty_like(local) for _ in range(c)]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        ctx.save_for_backward(inverse)
        ctx.cp_group, ctx.t_loc = cp_group, local.shape[0]
        return torch.cat(parts)[inverse]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        flat = torch.zeros_like(g)
        flat[inverse] = g
        dist.all_reduce(flat, group=ctx.cp_group)
        r = dist.get_rank(ctx.cp_group)
        return flat[r * ctx.t_loc : (r + 1) * ctx.t_loc], None, None


def gather_from_cp(local: Tensor, padded_cu_seqlens: Tensor, cp_group: ProcessGroup) -> Tensor:
    """Differentiable: this rank's ``[T/c]`` values -> all ranks' values in global order."""
    if dist.get_world_size(cp_group) == 1:
        return local
    inverse = zigzag_inverse(padded_cu_seqlens, dist.get_world_size(cp_group))
    return apply(_GatherFromCP, local, inverse, cp_group)


def split_targets_for_cp(
    rows: Tensor, padded_cu_seqlens: Tensor, *, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor]:
    """The loss positions whose hidden row ``cp_rank`` holds, for a micro-batch packed as
    prefix tries (``rows [M]``: the global row each loss position reads): their indices into
    the ``[M]`` loss side, and the local rows they read. Each position belongs to exactly one
    CP rank, so the ranks' loss shares add up to the whole loss."""
    pos = zigzag_positions(padded_cu_seqlens, cp_size, cp_rank)
    local = torch.full((int(padded_cu_seqlens[-1]),), -1, dtype=torch.long)
    local[pos] = torch.arange(pos.numel())
    at = local[rows]
    keep = torch.nonzero(at >= 0).squeeze(1)
    return keep, at[keep]


@torch.no_grad()
def gather_targets_from_cp(
    local: Tensor, index: Tensor, total: int, cp_group: ProcessGroup
) -> Tensor:
    """Per-position values of every CP rank's loss positions (``local`` at ``index`` into
    ``[total]``, from ``split_targets_for_cp``) put together in ``[total]`` order. No grad:
    for reporting (log-probs, entropy)."""
    c = dist.get_world_size(cp_group)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(c)]
    dist.all_gather(counts, torch.tensor([local.numel()]), group=cp_group)
    width = int(max(int(n) for n in counts))
    padded = torch.zeros(width, dtype=local.dtype)
    padded[: local.numel()] = local
    where = torch.zeros(width, dtype=torch.long)
    where[: index.numel()] = index
    values = [torch.empty_like(padded) for _ in range(c)]
    places = [torch.empty_like(where) for _ in range(c)]
    dist.all_gather(values, padded, group=cp_group)
    dist.all_gather(places, where, group=cp_group)
    out = torch.zeros(total, dtype=local.dtype)
    for n, v, p in zip(counts, values, places, strict=True):
        out[p[: int(n)]] = v[: int(n)]
    return out
