"""Turn a host micro-batch into what this rank's pipeline stage needs.

TP rank 0 of each (DP, CP, PP) slot reads the host arrays, cuts its CP shard (zigzag, every
token field by one map) and broadcasts over its TP group what the stage needs
(``workers/ops/pp_broadcast.py``): tokens and positions on the first stage; labels, loss mask
and per-token loss inputs on the last; the packed-sequence metadata on every stage. The other
TP ranks only learn shapes from the plan. ``cu_seqlens`` stay *global* (padded): attention
under CP and RoPE need them; the local boundaries are ``cu // cp``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.control.batch import LOSS_INPUTS, PackedMicroBatch
from trainctl.workers.ops.cp import PackedTokens, split_for_cp
from trainctl.workers.ops.pp_broadcast import (
    BroadcastConfig,
    StageBatch,
    StageRole,
    broadcast_stage_batch,
)


@dataclass(frozen=True, kw_only=True)
class RankMicroBatch:
    """One micro-batch as this rank sees it; token fields are CP-local ``[1, T / cp]``."""

    batch: StageBatch
    packed: PackedSeqParams  # global padded cu_seqlens and max length
    is_dummy: bool


@dataclass(frozen=True, kw_only=True)
class StageInputs:
    """Prepares micro-batches for one rank; built once per engine from its coordinates."""

    role: StageRole
    cp_size: int
    cp_rank: int
    tp_group: ProcessGroup
    tp_src: int
    """Global rank of TP rank 0 of this rank's TP group: the one that reads host data."""

    def loss_inputs(self, mb: PackedMicroBatch) -> tuple[str, ...]:
        return ("loss_scale", *(k for k in LOSS_INPUTS if getattr(mb, k) is not None))

    def prepare(self, mb: PackedMicroBatch) -> RankMicroBatch:
        sender = dist.get_rank() == self.tp_src
        inputs = self.loss_inputs(mb)
        batch = self._read(mb, inputs) if sender else None
        if dist.get_world_size(self.tp_group) > 1:
            cfg = BroadcastConfig(seq_length=mb.num_tokens // self.cp_size, loss_inputs=inputs)
            batch = broadcast_stage_batch(
                batch, role=self.role, cfg=cfg, tp_group=self.tp_group, src=self.tp_src
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
        tokens = packed_tokens(mb)
        if self.cp_size > 1:
            tokens = split_for_cp(tokens, cp_size=self.cp_size, cp_rank=self.cp_rank).tokens
        return StageBatch(
            tokens=tokens.input_ids[None],
            position_ids=tokens.position_ids[None],
            labels=tokens.labels[None],
            loss_mask=tokens.loss_mask[None],
            loss_inputs={k: getattr(tokens, k)[None] for k in inputs},
            cu_seqlens=torch.from_numpy(mb.cu_seqlens.copy()),
            max_seqlen=torch.tensor([mb.max_seqlen], dtype=torch.int32),
        )


def packed_tokens(mb: PackedMicroBatch) -> PackedTokens:
    """The host micro-batch as tensors (copies: object-store arrays are read-only)."""

    def t(x: np.ndarray | None) -> Tensor | None:
        return None if x is None else torch.from_numpy(np.array(x))

    fields = {f.name: t(getattr(mb, f.name)) for f in dataclasses.fields(PackedTokens)}
    return PackedTokens(**fields)  # type: ignore[arg-type]
