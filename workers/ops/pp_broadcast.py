"""Broadcast a micro-batch from TP rank 0 to the other TP ranks of a pipeline stage
(docs/algorithms.md §4).

The data reaches TP rank 0 of each stage; it broadcasts over the TP group what its stage needs.
Every stage - first, intermediate *and* last - runs transformer layers, so every stage gets the
packed-sequence metadata (``cu_seqlens``, ``max_seqlen``); upstream once forgot intermediate
stages (issue #4092) and one fix still forgot the last stage. Which items are sent is decided by
the stage role and shared configuration, never by the data, so sender and receivers make the
same calls in the same order:

| role         | items                                                                 |
|--------------|-----------------------------------------------------------------------|
| only (pp=1)  | tokens, position_ids, labels, loss_mask, loss inputs, mask, cu, max    |
| first        | tokens, position_ids, attention_mask, cu_seqlens, max_seqlen           |
| intermediate | attention_mask, cu_seqlens, max_seqlen                                 |
| last         | labels, loss_mask, loss inputs, attention_mask, cu_seqlens, max_seqlen |

``cu_seqlens`` has a variable length: its element count goes first (int64; 0 means None, and
then no data broadcast follows, on both sides), then the data.
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


_FIRST = ("tokens", "position_ids")
_LAST = ("labels", "loss_mask")


def _items(role: StageRole, cfg: BroadcastConfig) -> list[str]:
    names: list[str] = []
    if role in (StageRole.ONLY, StageRole.FIRST):
        names += _FIRST
    if role in (StageRole.ONLY, StageRole.LAST):
        names += _LAST + tuple(f"loss_inputs.{k}" for k in cfg.loss_inputs)
    if cfg.has_attention_mask:
        names.append("attention_mask")
    if cfg.has_cu_seqlens:
        names += ["cu_seqlens", "max_seqlen"]
    return names


def _spec(name: str, cfg: BroadcastConfig) -> tuple[tuple[int, ...], torch.dtype]:
    b, s = cfg.micro_batch_size, cfg.seq_length
    if name in ("tokens", "position_ids", "labels"):
        return (b, s), torch.int64
    if name == "attention_mask":
        return (b, 1, s, s), torch.bool
    if name == "max_seqlen":
        return (1,), torch.int32
    if name.startswith("loss_inputs."):
        return (b, s), torch.float64  # exact for fp32 inputs, and loss scales need fp64
    return (b, s), torch.float32  # loss_mask


def _get(batch: StageBatch, name: str) -> Tensor | None:
    if name.startswith("loss_inputs."):
        return batch.loss_inputs.get(name.split(".", 1)[1])
    return getattr(batch, name)  # type: ignore[no-any-return]


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
        if name == "cu_seqlens":
            got[name] = _broadcast_varlen(mine, tp_group=tp_group, src=src)
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
    return replace(StageBatch(), loss_inputs=inputs, **plain)  # type: ignore[arg-type]


_REFUSED = -1
"""Element count the sender broadcasts when it refuses its own ``cu_seqlens``, so that the
receivers raise too instead of waiting for data that never comes."""


def _broadcast_varlen(t: Tensor | None, *, tp_group: ProcessGroup, src: int) -> Tensor | None:
    """``cu_seqlens`` as a 1-D int32 ``[n]`` on every rank, the sender included.

    Megatron collates it as ``[1, n]`` (micro-batch size 1); the sender flattens that, so every
    TP rank holds the same shape. Any other 2-D shape (several packed rows) is refused on all
    ranks of the group.
    """
    sender = dist.get_rank() == src
    problem = None
    if sender and t is not None and not (t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1)):
        problem = f"cu_seqlens must be [n] or [1, n], got shape {tuple(t.shape)}"
    count = _REFUSED if problem else (0 if t is None else t.numel())
    n = torch.tensor([count], dtype=torch.int64)
    dist.broadcast(n, src=src, group=tp_group)
    if int(n) == _REFUSED:
        raise ValueError(problem or f"TP source rank {src} refused its cu_seqlens")
    if int(n) == 0:
        return None  # both sides skip the data broadcast
    if sender and t is not None:
        buf = t.to(torch.int32).reshape(-1).contiguous()
    else:
        buf = torch.empty(int(n), dtype=torch.int32)
    dist.broadcast(buf, src=src, group=tp_group)
    return buf
