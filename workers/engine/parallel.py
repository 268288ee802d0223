"""``ParallelDims``: this rank's process groups and coordinates, built once and passed down.

megatron-core keeps its parallel state in module globals; this is the one place that reads
them. Everything below the engine (``workers/ops``, the inputs, the schedule's loss) gets its
groups from this object, never from megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from torch.distributed import ProcessGroup

from trainctl.workers.engine.boundary import RankCoords
from trainctl.workers.engine.config import EngineConfig, ParallelLayout
from trainctl.workers.ops.pp_broadcast import StageRole


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    layout: ParallelLayout
    coords: RankCoords
    tp_group: ProcessGroup
    cp_group: ProcessGroup
    dp_cp_group: ProcessGroup
    """Data x context parallel: the group over which gradients and loss shares are summed."""
    mp_group: ProcessGroup
    """Tensor x pipeline parallel: one full model replica."""
    ep_group: ProcessGroup
    expert_dp_group: ProcessGroup
    """The ranks holding the same experts: expert gradients are summed over it."""
    embd_group: ProcessGroup | None
    """The first and the last stage's ranks of this TP slice (tied embeddings); None on the
    stages in between."""
    tp_src: int
    """Global rank of TP rank 0 of this rank's TP group: the one that reads host data."""
    expert_tp_rank: int
    expert_dp_rank: int
    stages: tuple[tuple[bool, bool], ...]
    """Per virtual stage of this rank: (holds the embedding, holds the output layer)."""
    is_last_stage: bool
    """This rank's physical stage is the last: it computes the loss."""

    def holds_replica0(self, name: str) -> bool:
        """This rank holds replica 0 of parameter ``name`` (megatron's local name): dense
        tensors are replicated over DP x CP, experts over expert-data-parallel ranks. Replica
        0's copies add up to one full model, each element once."""
        if ".local_experts." in name:
            return self.expert_dp_rank == 0
        return self.coords.dp == 0 and self.coords.cp == 0

    @classmethod
    def build(cls, layout: ParallelLayout, *, timeout_s: float) -> ParallelDims:
        """Initialise megatron's parallel state for ``layout`` and read it, once."""
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"layout {layout.describe()} needs {layout.world_size} ranks, "
                f"the process group has {dist.get_world_size()}"
            )
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vp if layout.vp > 1 else None,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            # Experts are whole on every TP rank (workers/engine/experts.py): under sequence
            # parallelism each TP rank routes its own tokens through them.
            expert_tensor_parallel_size=1,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
        vps = [v if layout.vp > 1 else None for v in range(layout.vp)]
        return cls(
            layout=layout,
            coords=RankCoords(
                rank=dist.get_rank(),
                dp=mpu.get_data_parallel_rank(),
                cp=mpu.get_context_parallel_rank(),
                tp=mpu.get_tensor_model_parallel_rank(),
                pp=mpu.get_pipeline_model_parallel_rank(),
                ep=mpu.get_expert_model_parallel_rank(),
            ),
            tp_group=mpu.get_tensor_model_parallel_group(),
            cp_group=mpu.get_context_parallel_group(),
            dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
            mp_group=mpu.get_model_parallel_group(),
            ep_group=mpu.get_expert_model_parallel_group(),
            expert_dp_group=mpu.get_expert_data_parallel_group(),
            embd_group=mpu.get_embedding_group(check_initialized=False),
            tp_src=mpu.get_tensor_model_parallel_src_rank(),
            expert_tp_rank=mpu.get_expert_tensor_parallel_rank(),
            expert_dp_rank=mpu.get_expert_data_parallel_rank(),
            stages=tuple(
                (
                    mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                    mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                )
                for v in vps
            ),
            is_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=True),
        )

    @property
    def stage_role(self) -> StageRole:
        return StageRole.of(self.coords.pp, self.layout.pp)

    def vocab_start(self, vocab_size: int) -> int:
        """First vocabulary id of this TP rank's slice of the output layer."""
        return self.coords.tp * (vocab_size // self.layout.tp)

    def reports_logprobs(self) -> bool:
        """The one rank per DP slot that returns per-token results: TP 0, CP 0, last stage."""
        return self.is_last_stage and self.coords.tp == 0 and self.coords.cp == 0


@dataclass(frozen=True)
class ShardContext:
    """What every collaborator of an engine shard reads and none owns: the engine's config,
    the rank's place (its coordinates and process groups) and its model chunks."""

    cfg: EngineConfig
    dims: ParallelDims
    chunks: list[Any]

    @property
    def coords(self) -> RankCoords:
        return self.dims.coords
