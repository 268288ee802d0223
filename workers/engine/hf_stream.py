"""A rank's own parameters as pieces of the Hugging Face tensors they belong to: what a
weight sync streams from the ranks that own them, so no rank gathers the model.

A canonical tensor (``weights.py``) maps to one or more Hugging Face tensors (``hf.split``:
q/k/v, gate/up, Gated DeltaNet's projections). Under TP a rank holds a shard of it
(``weights.shard_rule``), which is a set of the full tensor's rows (or, for a row-parallel
linear, a block of its columns). Which rows of which Hugging Face tensor those are is found by
running ``hf.split`` on the full tensor's *row numbers* instead of its values: the same code
that converts the whole model converts a shard, so the two cannot disagree. A shard's rows
land in each Hugging Face tensor as a few contiguous runs (one for q, one for k, ...); each
run is one ``HfPiece``, placed by its offset along one dimension. A run whose rows are also
contiguous in the shard is a view of the parameter (no copy); the rest are gathered.

Who sends what, so every element goes once: a dense tensor from DP x CP replica 0, an expert
from expert-data-parallel replica 0 (``ParallelDims.holds_replica0``), and a tensor that TP
replicates (norms, routers) from TP rank 0 alone; an expert, whole on the rank that holds it,
from that rank at any TP coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from trainctl.workers.engine import hf
from trainctl.workers.engine.config import ModelConfig
from trainctl.workers.engine.families import Fuse
from trainctl.workers.engine.weights import ShardRule, shard_rule


@dataclass(frozen=True, slots=True)
class HfPiece:
    """Part of one Hugging Face tensor: ``tensor`` sits at ``start`` along dimension ``dim``
    of the tensor called ``name``, whose full shape is ``full``."""

    name: str
    dim: int
    start: int
    full: tuple[int, ...]
    tensor: Callable[[], Tensor]
    """The piece's values, made when asked (a view of the parameter, or its rows gathered):
    a sync converts one bucket at a time."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: bool
    """``tensor()`` is a view of the parameter, contiguous: it can travel without a copy."""


def owned_pieces(
    named: Iterator[tuple[str, Tensor]], m: ModelConfig, *, tp_rank: int, tp: int
) -> Iterator[HfPiece]:
    """The pieces of Hugging Face tensors that ``named`` (this rank's owned parameters by
    canonical name, in any order) adds to one copy of the model, in canonical-name order; a
    TP-replicated tensor only from TP rank 0 (the module docstring)."""
    rows = {ours: (theirs, fuse) for ours, theirs, fuse in hf.rows(m)}
    for canon, p in sorted(named, key=lambda np: np[0]):
        if canon not in rows:
            raise ValueError(f"no {m.family} counterpart for {canon}")
        theirs, fuse = rows[canon]
        rule = shard_rule(canon)
        p = p.detach()
        if rule.kind == "replicated" or tp == 1:
            if tp_rank == 0 or tp == 1 or ".local_experts." in canon:
                yield from _whole(p, theirs, fuse, m)
        elif rule.kind == "dim" and rule.dim == 1:
            if fuse:
                raise ValueError(f"{canon}: a column-split tensor that {fuse!r} fuses")
            shape = tuple(p.shape)
            full = rule.full_shape(p.shape, tp)
            view = p.is_contiguous()
            yield HfPiece(theirs[0], 1, tp_rank * shape[1], full, _itself(p), shape, p.dtype, view)
        else:
            yield from _row_runs(p, theirs, fuse, m, rule, tp_rank, tp)


def _whole(p: Tensor, theirs: tuple[str, ...], fuse: Fuse, m: ModelConfig) -> Iterator[HfPiece]:
    """A tensor this rank holds whole: each of its Hugging Face parts, whole. Parts that
    ``hf.split`` has to copy (q, k and v, regrouped) are made when the first is asked for,
    and each is let go once taken: a sync holds them only while their bucket is packed."""
    parts: dict[int, Tensor] = {}

    def values(j: int) -> Tensor:
        if j not in parts:
            parts.update(enumerate(hf.split(p, fuse, m)))
        return parts.pop(j).contiguous()

    probe = p.to("meta")  # shapes, and which parts are views, without copying a byte
    for j, (name, part) in enumerate(zip(theirs, hf.split(probe, fuse, m), strict=True)):
        shape = tuple(part.shape)
        view = part.is_contiguous() and (part is probe or part._base is probe)
        yield HfPiece(name, 0, 0, shape, partial(values, j), shape, p.dtype, view)


@dataclass(frozen=True, slots=True)
class RowRun:
    """Rows ``start`` to ``start + len(local)`` of the Hugging Face tensor ``name`` (``rows``
    rows in all) are rows ``local`` of a rank's shard, in that order."""

    name: str
    start: int
    rows: int
    local: Tensor


def row_runs(
    shape: tuple[int, ...], theirs: tuple[str, ...], fuse: Fuse, m: ModelConfig,
    rule: ShardRule, tp_rank: int, tp: int,
) -> Iterator[RowRun]:  # fmt: skip
    """Where the rows of a row-split shard (``dim 0`` or ``glu``, of local ``shape``) are in
    its Hugging Face parts: contiguous runs, found by splitting the full tensor's row numbers
    with ``hf.split``. The export sends each run; the import reads each one."""
    full_rows = rule.full_shape(torch.Size(shape), tp)[0]
    index = torch.arange(full_rows).view(full_rows, *([1] * (len(shape) - 1)))
    held = rule.shard(index, tp_rank, tp).reshape(-1)  # the canonical row of each local row
    local_of = torch.full((full_rows,), -1, dtype=torch.long)
    local_of[held] = torch.arange(held.numel())
    for name, part in zip(theirs, hf.split(index, fuse, m), strict=True):
        local = local_of[part.reshape(-1)]
        for run in _runs(torch.nonzero(local >= 0).reshape(-1)):
            yield RowRun(name, int(run[0]), int(part.shape[0]), local[run])


def _row_runs(
    p: Tensor, theirs: tuple[str, ...], fuse: Fuse, m: ModelConfig, rule: ShardRule,
    tp_rank: int, tp: int,
) -> Iterator[HfPiece]:  # fmt: skip
    """A row-split shard's pieces: one for each of its ``row_runs``."""
    rest = tuple(p.shape[1:])
    for run in row_runs(tuple(p.shape), theirs, fuse, m, rule, tp_rank, tp):
        rows = run.local
        first, length = int(rows[0]), int(rows.numel())
        contiguous = bool(torch.equal(rows, torch.arange(first, first + length)))
        yield HfPiece(
            run.name, 0, run.start, (run.rows, *rest), _rows(p, rows, contiguous),
            (length, *rest), p.dtype, contiguous and p.is_contiguous(),
        )  # fmt: skip


def _itself(p: Tensor) -> Callable[[], Tensor]:
    return lambda: p


def _runs(positions: Tensor) -> list[Tensor]:
    """``positions`` (ascending) cut where they stop being consecutive."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).reshape(-1) + 1
    return list(torch.tensor_split(positions, breaks))


def _rows(p: Tensor, rows: Tensor, contiguous: bool) -> Callable[[], Tensor]:
    """The piece's values: a slice of the parameter, or its rows gathered."""
    first, length = int(rows[0]), int(rows.numel())
    if contiguous:
        return lambda: p[first : first + length]
    return lambda: p.index_select(0, rows)
