"""Turn a host micro-batch into what this rank's pipeline stage needs.

TP rank 0 of each (DP, CP, PP) slot reads the host arrays, cuts its CP shard (zigzag, every
per-token field by one map: ``workers/ops/cp.py``) and broadcasts over its TP group what the
stage needs (``workers/ops/pp_broadcast.py``): tokens and positions on the first stage; labels,
loss mask and per-token loss inputs on the last; the packed-sequence metadata on every stage.
The other TP ranks only learn shapes from the plan. ``cu_seqlens`` stay *global* (padded):
attention under CP needs them; the local boundaries are ``cu // cp``.

A micro-batch packed as prefix tries (``PackedMicroBatch.tree``) gives the model the tries'
tokens, depths and segment table, and the loss its flat per-sequence arrays with ``rows``, the
trie row each loss position reads (docs/algorithms.md §10). Under CP the tries are zigzag-split
like sequences, and each CP rank takes the loss positions whose row it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from trainctl.workers.engine.attention import PackedBatchParams
from trainctl.workers.engine.boundary import PackedMicroBatch
from trainctl.workers.engine.parallel import ParallelDims
from trainctl.workers.ops.cp import split_for_cp, split_targets_for_cp
from trainctl.workers.ops.pp_broadcast import BroadcastConfig, StageBatch, broadcast_stage_batch
from trainctl.workers.ops.tree_attention import Segments


@dataclass(frozen=True, kw_only=True)
class RankMicroBatch:
    """One micro-batch as this rank sees it; token fields are CP-local ``[1, T / cp]``."""

    batch: StageBatch
    packed: PackedBatchParams  # global padded cu_seqlens and max length; a tree's segments
    is_dummy: bool
    num_sequences: int = 0
    """Packed sequences of the micro-batch (the per-sequence metrics' length on every rank)."""
    targets: Tensor | None = None
    """Prefix tries under CP: the indices, into the micro-batch's ``[num_targets]`` loss
    positions, of those this CP rank computes (the ones whose hidden row it holds)."""
    num_targets: int = 0
    index: int = 0
    """Its place in the pass's micro-batches (each model chunk of a rank sees every one)."""


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


_CPU = torch.device("cpu")


@dataclass(frozen=True)
class StageInputs:
    """Prepares micro-batches for one rank; built once per engine from its ``ParallelDims``.

    The model's and the loss's tensors end on ``device`` (the rank's GPU on CUDA); the packing
    metadata (boundaries, segment table) stays on the host, where attention reads it as
    Python numbers. The TP broadcast happens before the move, on the host."""

    dims: ParallelDims
    device: torch.device = _CPU

    def prepare(self, mb: PackedMicroBatch) -> RankMicroBatch:
        d = self.dims
        tree = mb.tree is not None
        targets = self._cp_targets(mb)
        # seq_id goes along for the per-sequence metrics (float64 carries it exactly).
        inputs = ("loss_scale", "seq_id", *mb.loss_inputs)
        batch = self._read(mb, inputs, targets) if dist.get_rank() == d.tp_src else None
        if d.layout.tp > 1:
            # A tree's loss positions (this CP rank's, under CP) outnumber its rows.
            num_targets = None
            if tree:
                num_targets = mb.num_tokens if targets is None else len(targets[0])
            cfg = BroadcastConfig(
                seq_length=mb.model_tokens // d.layout.cp,
                loss_inputs=inputs,
                has_tree=tree,
                num_targets=num_targets,
            )
            batch = broadcast_stage_batch(
                batch, role=d.stage_role, cfg=cfg, tp_group=d.tp_group, src=d.tp_src
            )
        assert batch is not None and batch.cu_seqlens is not None
        assert batch.max_seqlen is not None
        max_len = int(batch.max_seqlen.reshape(()))  # a host tensor: no device sync
        segments = None
        if batch.segments is not None:
            segments = Segments.decode(batch.segments, mb.model_tokens)
        cu_device = None
        cu = batch.cu_seqlens
        if self.device.type != "cpu":
            batch = _to_device(batch, self.device)
            cu_device = cu.to(self.device, non_blocking=True)
        return RankMicroBatch(
            batch=batch,
            packed=PackedBatchParams(
                qkv_format="thd",
                cu_seqlens_q=batch.cu_seqlens,
                cu_seqlens_kv=batch.cu_seqlens,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
                # Host values, read here once (the tensors are on the host: no device sync).
                cu_host=tuple(cu.tolist()),
                max_len=max_len,
                cu_device=cu_device,
                tree=segments,
            ),
            is_dummy=mb.is_dummy,
            targets=None if targets is None else targets[0],
            num_targets=mb.num_tokens,
            num_sequences=int(mb.seq_lens.shape[0]),
        )

    def _cp_targets(self, mb: PackedMicroBatch) -> tuple[Tensor, Tensor] | None:
        """Prefix tries under CP: this CP rank's loss positions and the local rows they read
        (every TP rank computes them: the loss side's length depends on them)."""
        if mb.tree is None or self.dims.layout.cp == 1:
            return None
        return split_targets_for_cp(
            torch.from_numpy(np.array(mb.tree.rows)),
            torch.from_numpy(np.array(mb.tree.cu_seqlens)),
            cp_size=self.dims.layout.cp,
            cp_rank=self.dims.coords.cp,
        )

    def _read(
        self,
        mb: PackedMicroBatch,
        inputs: tuple[str, ...],
        targets: tuple[Tensor, Tensor] | None,
    ) -> StageBatch:
        t = packed_tokens(mb)
        if mb.tree is not None:
            return self._read_tree(mb, t.per_token, inputs, targets)
        per_token = t.per_token
        if self.dims.layout.cp > 1:
            cp = self.dims.layout.cp
            per_token = split_for_cp(
                per_token, t.cu_seqlens, cp_size=cp, cp_rank=self.dims.coords.cp
            ).per_token
        return StageBatch(
            tokens=per_token["input_ids"][None],
            position_ids=per_token["position_ids"][None],
            cu_seqlens=t.cu_seqlens,
            max_seqlen=torch.tensor([mb.max_seqlen], dtype=torch.int32),
            **_loss_side(per_token, inputs),
        )

    def _read_tree(
        self,
        mb: PackedMicroBatch,
        per_token: dict[str, Tensor],
        inputs: tuple[str, ...],
        targets: tuple[Tensor, Tensor] | None,
    ) -> StageBatch:
        tree = mb.tree
        assert tree is not None
        cu = torch.from_numpy(np.array(tree.cu_seqlens))
        model = {
            "input_ids": torch.from_numpy(np.array(tree.input_ids)),
            "position_ids": torch.from_numpy(np.array(tree.position_ids)),
        }
        rows = torch.from_numpy(np.array(tree.rows))
        if targets is not None:  # CP: this rank's zigzag rows, and the positions reading them
            cp = self.dims.layout.cp
            model = split_for_cp(model, cu, cp_size=cp, cp_rank=self.dims.coords.cp).per_token
            keep, rows = targets
            per_token = {k: v[keep] for k, v in per_token.items()}
        return StageBatch(
            tokens=model["input_ids"][None],
            position_ids=model["position_ids"][None],
            rows=rows[None],
            cu_seqlens=cu,
            max_seqlen=torch.tensor([tree.max_seqlen], dtype=torch.int32),
            segments=torch.from_numpy(np.array(tree.segments)),
            **_loss_side(per_token, inputs),
        )


_ON_DEVICE = ("tokens", "position_ids", "labels", "loss_mask", "rows")


def _to_device(batch: StageBatch, device: torch.device) -> StageBatch:
    """The per-token tensors of ``batch`` on ``device``; the metadata stays where it is."""
    moved: dict[str, Any] = {
        name: t.to(device, non_blocking=True)
        for name in _ON_DEVICE
        if (t := getattr(batch, name)) is not None
    }
    moved["loss_inputs"] = {
        k: v.to(device, non_blocking=True) for k, v in batch.loss_inputs.items()
    }
    return dataclasses.replace(batch, **moved)


def _loss_side(per_token: dict[str, Tensor], inputs: tuple[str, ...]) -> dict[str, Any]:
    """The last stage's per-position items: labels, mask and the loss inputs ``[1, M]``."""
    return {
        "labels": per_token["labels"][None],
        "loss_mask": per_token["loss_mask"][None],
        "loss_inputs": {k: per_token[k][None] for k in inputs},
    }
