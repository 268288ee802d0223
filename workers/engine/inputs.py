"""Turn a host micro-batch into what this rank's pipeline stage needs.

TP rank 0 of each (DP, CP, PP) slot reads the host arrays, cuts its CP shard (zigzag, every
per-token field by one map: ``workers/ops/cp.py``) and broadcasts over its TP group what the
stage needs (``workers/ops/pp_broadcast.py``): tokens and positions on the first stage; labels,
loss mask and per-token loss inputs on the last; the packed-sequence metadata on every stage.
The other TP ranks only learn shapes from the plan. ``cu_seqlens`` stay *global* (padded):
attention under CP and RoPE need them; the local boundaries are ``cu // cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from trainctl.workers.control.batch import PackedMicroBatch
from trainctl.workers.engine.parallel import ParallelDims
from trainctl.workers.ops.cp import split_for_cp
from trainctl.workers.ops.pp_broadcast import BroadcastConfig, StageBatch, broadcast_stage_batch


@dataclass(frozen=True, kw_only=True)
class RankMicroBatch:
    """One micro-batch as this rank sees it; token fields are CP-local ``[1, T / cp]``."""

    batch: StageBatch
    packed: PackedSeqParams  # global padded cu_seqlens and max length
    is_dummy: bool


@dataclass(frozen=True, kw_only=True)
class PackedTensors:
    """A host micro-batch as tensors, before any CP split (``PackedMicroBatch``'s names)."""

    per_token: dict[str, Tensor]
    cu_seqlens: Tensor  # [B+1] int32, padded boundaries (global)

    def __getattr__(self, name: str) -> Tensor:
        try:
            return self.per_token[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def num_tokens(self) -> int:
        return int(self.per_token["input_ids"].shape[0])


def packed_tokens(mb: PackedMicroBatch) -> PackedTensors:
    """The host micro-batch as tensors (copies: object-store arrays are read-only)."""
    return PackedTensors(
        per_token={k: torch.from_numpy(np.array(v)) for k, v in mb.per_token.items()},
        cu_seqlens=torch.from_numpy(np.array(mb.cu_seqlens)),
    )


@dataclass(frozen=True)
class StageInputs:
    """Prepares micro-batches for one rank; built once per engine from its ``ParallelDims``."""

    dims: ParallelDims

    def prepare(self, mb: PackedMicroBatch) -> RankMicroBatch:
        d = self.dims
        inputs = ("loss_scale", *mb.loss_inputs)
        batch = self._read(mb, inputs) if dist.get_rank() == d.tp_src else None
        if d.layout.tp > 1:
            cfg = BroadcastConfig(seq_length=mb.num_tokens // d.layout.cp, loss_inputs=inputs)
            batch = broadcast_stage_batch(
                batch, role=d.stage_role, cfg=cfg, tp_group=d.tp_group, src=d.tp_src
            )
        assert batch is not None and batch.cu_seqlens is not None
        assert batch.max_seqlen is not None
        max_len = batch.max_seqlen.reshape(())
        return RankMicroBatch(
            batch=batch,
            packed=PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=batch.cu_seqlens,
                cu_seqlens_kv=batch.cu_seqlens,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            ),
            is_dummy=mb.is_dummy,
        )

    def _read(self, mb: PackedMicroBatch, inputs: tuple[str, ...]) -> StageBatch:
        t = packed_tokens(mb)
        per_token = t.per_token
        if self.dims.layout.cp > 1:
            cp = self.dims.layout.cp
            per_token = split_for_cp(
                per_token, t.cu_seqlens, cp_size=cp, cp_rank=self.dims.coords.cp
            ).per_token
        return StageBatch(
            tokens=per_token["input_ids"][None],
            position_ids=per_token["position_ids"][None],
            labels=per_token["labels"][None],
            loss_mask=per_token["loss_mask"][None],
            loss_inputs={k: per_token[k][None] for k in inputs},
            cu_seqlens=t.cu_seqlens,
            max_seqlen=torch.tensor([mb.max_seqlen], dtype=torch.int32),
        )
