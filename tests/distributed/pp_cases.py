"""Rank functions for the PP metadata broadcast tests (docs/algorithms.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ops_cases import V, grid


def _stage_batch(n_seqs: int, seq_length: int, loss_inputs: tuple[str, ...]):
    from trainctl.workers.ops.pp_broadcast import StageBatch

    lengths = [seq_length // n_seqs] * (n_seqs - 1)
    lengths.append(seq_length - sum(lengths))
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(n_seqs)
    shape = (1, seq_length)
    return StageBatch(
        tokens=torch.randint(0, V, shape, generator=gen),
        position_ids=torch.arange(seq_length)[None],
        labels=torch.randint(0, V, shape, generator=gen),
        loss_mask=torch.ones(shape),
        loss_inputs={k: torch.randn(shape, generator=gen) for k in loss_inputs},
        cu_seqlens=cu,
        max_seqlen=torch.tensor([max(lengths)], dtype=torch.int32),
    )


TARGETS = 30
"""Loss positions of a tree micro-batch: more than its 24 rows (shared prefixes)."""


def _with_tree(full: Any, n: int) -> Any:
    """The batch as a tree micro-batch: a segment table of ``n``-dependent length, and loss
    positions (labels, mask, loss inputs, rows) of another length than the rows."""
    from trainctl.workers.ops import pp_broadcast as ppb

    gen = torch.Generator().manual_seed(100 + n)
    shape = (1, TARGETS)
    return ppb.replace(
        full,
        labels=torch.randint(0, V, shape, generator=gen),
        loss_mask=torch.ones(shape),
        loss_inputs={k: torch.randn(shape, generator=gen) for k in full.loss_inputs},
        rows=torch.randint(0, 24, shape, generator=gen),
        segments=torch.arange(3 * n + 2, dtype=torch.int64),
    )


def pp_broadcast_case(
    tp: int,
    pp: int,
    seq_counts: list[int],
    with_cu: bool = True,
    collated: bool = False,
    tree: bool = False,
) -> list[dict[str, Any]]:
    """Every TP rank of every stage gets what its stage needs; returns what each call sent.

    ``collated``: the sender's ``cu_seqlens`` is ``[1, n]``, as megatron collates it.
    ``tree``: micro-batches packed as prefix tries (segment table, rows, more loss positions
    than rows)."""
    from trainctl.workers.ops import pp_broadcast as ppb

    g = grid(tp=tp, pp=pp)
    role = ppb.StageRole.of(g.coords["pp"], pp)
    src = g.src_of("tp")
    sender = dist.get_rank() == src
    inputs = ("loss_scale", "advantages")
    cfg = ppb.BroadcastConfig(
        seq_length=24,
        loss_inputs=inputs,
        has_tree=tree,
        num_targets=TARGETS if tree else None,
    )
    calls: list[tuple[tuple[int, ...], str]] = []
    real = dist.broadcast

    def recording(t: Tensor, *a: Any, **k: Any) -> Any:
        calls.append((tuple(t.shape), str(t.dtype)))
        return real(t, *a, **k)

    out = []
    ppb.dist.broadcast = recording  # type: ignore[assignment]
    try:
        for n in seq_counts:
            full = _stage_batch(n, 24, inputs)
            if not with_cu:
                full = ppb.replace(full, cu_seqlens=None)
            elif collated:
                full = ppb.replace(full, cu_seqlens=full.cu_seqlens[None])
            if tree:
                full = _with_tree(full, n)
            got = ppb.broadcast_stage_batch(
                full if sender else None, role=role, cfg=cfg, tp_group=g.groups["tp"], src=src
            )
            res: dict[str, Any] = {"role": role.value}
            if with_cu:
                assert got.cu_seqlens is not None and got.cu_seqlens.dtype == torch.int32
                assert torch.equal(got.cu_seqlens.reshape(-1), full.cu_seqlens.reshape(-1))
                assert got.max_seqlen is not None and got.max_seqlen.dtype == torch.int32
                assert torch.equal(got.max_seqlen, full.max_seqlen)
            else:
                assert got.cu_seqlens is None
            first = role in (ppb.StageRole.ONLY, ppb.StageRole.FIRST)
            last = role in (ppb.StageRole.ONLY, ppb.StageRole.LAST)
            assert (got.tokens is not None) == first and (got.labels is not None) == last
            # Every stage applies rotary positions: every stage has the position ids.
            assert got.position_ids is not None
            assert torch.equal(got.position_ids, full.position_ids)
            assert (got.segments is not None) == tree and (got.rows is not None) == (tree and last)
            if tree:
                assert torch.equal(got.segments, full.segments)
                res["segments"] = got.segments.numel()
            if first:
                assert torch.equal(got.tokens, full.tokens)
            if last and tree:
                assert torch.equal(got.rows, full.rows) and got.labels.shape == (1, TARGETS)
            if last:
                assert torch.equal(got.labels, full.labels)
                assert set(got.loss_inputs) == set(inputs)
                assert torch.equal(
                    got.loss_inputs["advantages"], full.loss_inputs["advantages"].double()
                )
            res["cu"] = None if got.cu_seqlens is None else got.cu_seqlens.tolist()
            res["cu_shape"] = None if got.cu_seqlens is None else tuple(got.cu_seqlens.shape)
            out.append(res)
    finally:
        ppb.dist.broadcast = real  # type: ignore[assignment]
    # The sender's and the receivers' call sequences are identical, shapes and dtypes.
    seqs: list[Any] = [None] * tp
    dist.all_gather_object(seqs, calls, group=g.groups["tp"])
    assert all(s == seqs[0] for s in seqs), seqs
    return out


def pp_broadcast_refused_case() -> str:
    """A sender with several packed rows (``[2, n]`` cu_seqlens) is refused on every TP rank."""
    from trainctl.workers.ops import pp_broadcast as ppb

    g = grid(tp=2)
    src = g.src_of("tp")
    full = _stage_batch(3, 24, ())
    assert full.cu_seqlens is not None
    full = ppb.replace(full, cu_seqlens=full.cu_seqlens.repeat(2, 1))
    cfg = ppb.BroadcastConfig(seq_length=24)
    try:
        ppb.broadcast_stage_batch(
            full if dist.get_rank() == src else None,
            role=ppb.StageRole.ONLY,
            cfg=cfg,
            tp_group=g.groups["tp"],
            src=src,
        )
    except ValueError as e:
        return str(e)
    return "accepted"
