"""Broadcast a micro-batch from TP rank 0 to the other TP ranks of a pipeline stage
(docs/algorithms.md §4).

The data reaches TP rank 0 of each stage; it broadcasts over the TP group what its stage needs.
Every stage - first, intermediate *and* last - runs transformer layers, so every stage gets the
packed-sequence metadata (``cu_seqlens``, ``max_seqlen``); upstream once forgot intermediate
stages (issue #4092) and one fix still forgot the last stage. Which items are sent is decided by
the stage role and shared configuration, never by the data, so sender and receivers make the
same calls in the same order:

| role         | items                                                                   |
|--------------|-------------------------------------------------------------------------|
| only (pp=1)  | tokens, positions, labels, loss_mask, loss inputs, rows, mask, metadata |
| first        | tokens, positions, attention_mask, metadata                             |
| intermediate | positions, attention_mask, metadata                                     |
| last         | positions, labels, loss_mask, loss inputs, rows, attention_mask, metadata |

``metadata`` is ``cu_seqlens`` and ``max_seqlen``, and for a micro-batch packed as prefix tries
(``has_tree``) the tree's segment table: which rows each token attends to. Every stage applies
rotary positions in its attention, so every stage gets the position ids (a trie token's
position is its depth, not its index). ``rows`` (trees only) maps each of the last stage's
``num_targets`` loss positions to the hidden row that predicts it.

``cu_seqlens`` and the segment table have a variable length: the element count goes first
(int64; 0 means None, and then no data broadcast follows, on both sides), then the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class StageRole(str, Enum):
    ONLY = "only"
    FIRST = "first"
    INTERMEDIATE = "intermediate"
    LAST = "last"

    @classmethod
    def of(cls, pp_rank: int, pp_size: int) -> StageRole:
        if pp_size == 1:
            return cls.ONLY
        if pp_rank == 0:
            return cls.FIRST
        return cls.LAST if pp_rank == pp_size - 1 else cls.INTERMEDIATE


@dataclass(frozen=True, kw_only=True)
class BroadcastConfig:
    """Shared by every rank of the stage: decides which items exist and their shapes."""

    seq_length: int
    micro_batch_size: int = 1
    has_cu_seqlens: bool = True
    has_attention_mask: bool = False
    has_tree: bool = False
    """The micro-batch is packed as prefix tries: segments to every stage, rows to the last."""
    num_targets: int | None = None
    """Loss positions of the last stage's per-token items (default ``seq_length``; a tree's
    loss positions outnumber its rows)."""
    loss_inputs: tuple[str, ...] = ()
    """Per-token float inputs of the loss the last stage needs (``loss_scale``, ...)."""


@dataclass(frozen=True, kw_only=True)
class StageBatch:
    """What one stage's rank holds after the broadcast; absent items are None."""

    tokens: Tensor | None = None  # [mbs, s] int64
    position_ids: Tensor | None = None  # [mbs, s] int64
    labels: Tensor | None = None  # [mbs, s] int64
    loss_mask: Tensor | None = None  # [mbs, s] fp32
    loss_inputs: dict[str, Tensor] = field(default_factory=dict)  # name -> [mbs, s] fp64
    attention_mask: Tensor | None = None  # [mbs, 1, s, s] bool
    cu_seqlens: Tensor | None = None  # [n] int32
    max_seqlen: Tensor | None = None  # [1] int32
    segments: Tensor | None = None  # [n] int64, the tree's segment table
    rows: Tensor | None = None  # [mbs, num_targets] int64


_LAST = ("labels", "loss_mask")
_VARLEN = {"cu_seqlens": torch.int32, "segments": torch.int64}


def _items(role: StageRole, cfg: BroadcastConfig) -> list[str]:
    names: list[str] = []
    if role in (StageRole.ONLY, StageRole.FIRST):
        names.append("tokens")
    names.append("position_ids")
    if role in (StageRole.ONLY, StageRole.LAST):
        names += _LAST + tuple(f"loss_inputs.{k}" for k in cfg.loss_inputs)
        if cfg.has_tree:
            names.append("rows")
    if cfg.has_attention_mask:
        names.append("attention_mask")
    if cfg.has_cu_seqlens:
        names += ["cu_seqlens", "max_seqlen"]
    if cfg.has_tree:
        names.append("segments")
    return names


def _spec(name: str, cfg: BroadcastConfig) -> tuple[tuple[int, ...], torch.dtype]:
    b, s = cfg.micro_batch_size, cfg.seq_length
    m = s if cfg.num_targets is None else cfg.num_targets
    if name in ("tokens", "position_ids"):
        return (b, s), torch.int64
    if name in ("labels", "rows"):
        return (b, m), torch.int64
    if name == "attention_mask":
        return (b, 1, s, s), torch.bool
    if name == "max_seqlen":
        return (1,), torch.int32
    if name.startswith("loss_inputs."):
        return (b, m), torch.float64  # exact for fp32 inputs, and loss scales need fp64
    return (b, m), torch.float32  # loss_mask


def _get(batch: StageBatch, name: str) -> Tensor | None:
    if name.startswith("loss_inputs."):
        return batch.loss_inputs.get(name.split(".", 1)[1])
    value: Tensor | None = getattr(batch, name)
    return value


def broadcast_stage_batch(
    batch: StageBatch | None,
    *,
    role: StageRole,
    cfg: BroadcastConfig,
    tp_group: ProcessGroup,
    src: int,
) -> StageBatch:
    """TP rank 0 (``batch`` given, global rank ``src``) sends; the others receive."""
    sender = dist.get_rank() == src
    if sender and batch is None:
        raise ValueError("the source rank must pass the batch")
    got: dict[str, Tensor | None] = {}
    for name in _items(role, cfg):
        mine = _get(batch, name) if batch is not None and sender else None
        if name in _VARLEN:
            got[name] = _broadcast_varlen(mine, name, tp_group=tp_group, src=src)
            continue
        shape, dtype = _spec(name, cfg)
        if sender:
            t = mine
            if t is None:
                raise ValueError(f"stage {role.value} must send {name}, the batch has none")
            buf = t.to(dtype).reshape(shape).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype)
        dist.broadcast(buf, src=src, group=tp_group)
        got[name] = buf
    inputs = {k.split(".", 1)[1]: v for k, v in got.items() if k.startswith("loss_inputs.")}
    plain = {k: v for k, v in got.items() if not k.startswith("loss_inputs.")}
    return replace(StageBatch(), loss_inputs=inputs, **plain)  # type: ignore[arg-type]  # plain: its fields


_REFUSED = -1
"""Element count the sender broadcasts when it refuses its own varlen item, so that the
receivers raise too instead of waiting for data that never comes."""


def _broadcast_varlen(
    t: Tensor | None, name: str, *, tp_group: ProcessGroup, src: int
) -> Tensor | None:
    """``cu_seqlens`` (int32) or the segment table (int64) as a 1-D ``[n]`` on every rank, the
    sender included.

    Megatron collates ``cu_seqlens`` as ``[1, n]`` (micro-batch size 1); the sender flattens
    that, so every TP rank holds the same shape. Any other 2-D shape (several packed rows) is
    refused on all ranks of the group.
    """
    sender = dist.get_rank() == src
    problem = None
    if sender and t is not None and not (t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1)):
        problem = f"{name} must be [n] or [1, n], got shape {tuple(t.shape)}"
    count = _REFUSED if problem else (0 if t is None else t.numel())
    n = torch.tensor([count], dtype=torch.int64)
    dist.broadcast(n, src=src, group=tp_group)
    if int(n) == _REFUSED:
        raise ValueError(problem or f"TP source rank {src} refused its {name}")
    if int(n) == 0:
        return None  # both sides skip the data broadcast
    dtype = _VARLEN[name]
    if sender and t is not None:
        buf = t.to(dtype).reshape(-1).contiguous()
    else:
        buf = torch.empty(int(n), dtype=dtype)
    dist.broadcast(buf, src=src, group=tp_group)
    return buf
