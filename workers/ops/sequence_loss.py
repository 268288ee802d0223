"""Sequence-level loss inputs: one value per sequence, the same on every layout
(docs/algorithms.md §16).

A rank holds only part of a sequence: context parallelism splits it over CP ranks, and a
prefix trie lays it out among other sequences. What is per-sequence here is therefore built
from *sums*: each rank adds its own positions' values into one slot per sequence (by
``seq_id``, the sequence of each position), and the partial sums are all-reduced over the CP
group before anything is divided or exponentiated. A sequence never spans micro-batches or DP
ranks (the planner keeps each whole), and TP and PP ranks hold every position of the
micro-batch, so the CP all-reduce is the only one needed.

    gspo_log_ratio     GSPO-token: each token's log-ratio takes its sequence's mean log-ratio
                       over the ``sequence_ratio_mask`` tokens as its value, and its own
                       log-prob's gradient.
    behaviour_weights  sequence-level corrections of the train/sampler mismatch, from the
                       behaviour log-ratio ``b_t = old_lp - sampler_lp`` of the loss tokens:
                       seq-TIS ``min(exp(sum b), cap)``; seq-MIS ``exp(sum b)`` inside a band,
                       0 outside it; geometric-mean masking: 0 where ``exp(mean b)`` leaves its
                       band. Constants per sequence (no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.loss import MAX_LOG_RATIO


@dataclass(frozen=True)
class SequenceIndex:
    """Which sequence each of this rank's positions belongs to."""

    seq_id: Tensor
    """``[T]`` int64: the position's sequence, in ``[0, num_seqs)``."""
    num_seqs: int
    """Sequences of the micro-batch (the same on every rank of the CP group)."""
    cp_group: ProcessGroup | None
    """The ranks that hold the other positions of these sequences (None: this rank alone)."""

    def sums(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Per sequence ``[num_seqs]`` float64: the sum of ``values`` over the positions where
        ``mask`` is set, and their count, over every rank of the CP group (one all-reduce)."""
        w = (mask > 0).double()
        both = torch.zeros(2, self.num_seqs, dtype=torch.float64, device=values.device)
        both.index_add_(1, self.seq_id, torch.stack([values.detach().double() * w, w]))
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            dist.all_reduce(both, group=self.cp_group)
        return both[0], both[1]

    def first_holder(self) -> bool:
        """Whether this rank counts the per-sequence values in metrics (every CP rank holds
        them all after the all-reduce; one of them counts them)."""
        return self.cp_group is None or dist.get_rank(self.cp_group) == 0


@dataclass(frozen=True)
class GspoRatio:
    log_ratio: Tensor
    """``[T]``: the sequence's mean log-ratio (a constant) plus ``lp - sg(lp)``."""
    sequence_ratio: Tensor
    """``[num_seqs]`` float64: ``exp`` of each sequence's mean log-ratio (1 where it has no
    ratio token)."""
    has: Tensor
    """``[num_seqs]`` bool: sequences with at least one ratio token."""


def gspo_log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, ratio_mask: Tensor, seqs: SequenceIndex
) -> GspoRatio:
    """GSPO-token's per-token log-ratio: value ``mean_{t in M}(lp_t - old_t)`` over its
    sequence's ratio tokens ``M``, gradient that of ``lp`` at the token itself."""
    mask = ratio_mask > 0
    delta = torch.where(mask, logprobs.detach() - old_logprobs, torch.zeros_like(logprobs))
    total, count = seqs.sums(delta, mask)
    has = count > 0
    mean = torch.where(has, total / count.clamp(min=1), 0.0)
    own = logprobs - logprobs.detach()
    return GspoRatio(
        log_ratio=mean[seqs.seq_id].to(logprobs.dtype) + own,
        sequence_ratio=mean.clamp(max=MAX_LOG_RATIO).exp(),
        has=has,
    )


@dataclass(frozen=True)
class Band:
    """A closed interval ``[low, high]`` of ratios; ``high`` may be ``inf``."""

    low: float
    high: float

    def holds(self, ratio: Tensor) -> Tensor:
        return (ratio >= self.low) & (ratio <= self.high)


@dataclass(frozen=True)
class BehaviourCorrection:
    """The sequence-level corrections of a loss (each None when off); seq-TIS and seq-MIS
    exclude each other, geometric-mean masking combines with either."""

    tis_cap: float | None = None
    mis_band: Band | None = None
    geo_band: Band | None = None


@dataclass(frozen=True)
class BehaviourWeights:
    weight: Tensor
    """``[T]``: each position's sequence weight (a constant) for the policy term."""
    sequence_ratio: Tensor
    """``[num_seqs]`` float64: ``exp(sum b)`` per sequence, the log capped at 20."""
    geometric_ratio: Tensor
    """``[num_seqs]`` float64: ``exp(mean b)`` per sequence."""
    masked: Tensor
    """``[num_seqs]`` bool: sequences whose weight a band set to 0."""
    has: Tensor
    """``[num_seqs]`` bool: sequences with at least one loss token."""


def behaviour_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    seqs: SequenceIndex,
    correction: BehaviourCorrection,
    dtype: torch.dtype,
) -> BehaviourWeights:
    """Each loss sequence's weight from its behaviour log-ratio ``b = old - sampler`` summed
    over its loss tokens, broadcast to its positions (see the module docstring)."""
    mask = loss_mask > 0
    b = torch.where(mask, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))
    total, count = seqs.sums(b, mask)
    has = count > 0
    ratio = total.clamp(max=MAX_LOG_RATIO).exp()
    geometric = torch.where(has, total / count.clamp(min=1), 0.0).exp()
    weight = torch.ones_like(ratio)
    keep = torch.ones_like(has)
    if correction.tis_cap is not None:
        weight = ratio.clamp(max=correction.tis_cap)
    if correction.mis_band is not None:
        keep &= correction.mis_band.holds(ratio)
        weight = ratio
    if correction.geo_band is not None:
        keep &= correction.geo_band.holds(geometric)
    weight = torch.where(keep, weight, 0.0)
    return BehaviourWeights(
        weight=weight[seqs.seq_id].to(dtype),
        sequence_ratio=ratio,
        geometric_ratio=geometric,
        masked=~keep & has,
        has=has,
    )
