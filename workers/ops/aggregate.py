"""DP x CP loss aggregation: the loss every layout reports is the global token mean.

Each rank's loss share is ``sum(term_t * loss_scale_t)`` over its own tokens, with the global
normaliser already folded into ``loss_scale`` on the host (docs/algorithms.md §1.5, §2). The
shares of all data- and context-parallel ranks therefore *add up* to the single-process loss:
aggregating is a sum over the DP x CP group, never a mean of means (which weights a rank's
tokens by how many it happened to get).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def aggregate_loss(shares: Iterable[Tensor], dp_cp_group: ProcessGroup | None) -> Tensor:
    """The global loss from this rank's per-micro-batch loss shares: summed in float64 on the
    host over the micro-batches, then over every rank of ``dp_cp_group`` (None: this rank
    alone; on CUDA the group's CPU backend carries it).

    Every rank of the group must call it (it is a collective); each gets the same value.
    """
    total = torch.zeros((), dtype=torch.float64)
    for share in shares:
        total += share.detach().double().reshape(()).cpu()
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        dist.all_reduce(total, group=dp_cp_group)
    return total
