"""The metrics RL users read on every step, recorded through the CP-invariant tracker
(``metrics.py``) so they come out the same on any DP x CP layout (docs/algorithms.md §1.7).

Over the loss tokens, with ``lp`` the trainer's log-prob, ``old`` the behaviour policy's (the
sampler's, as sent) and ``r = exp(lp - old)``:
    ratio:mean / :min / :max          the importance ratio ``r``
    loss_tokens:sum, loss_sequences:sum   what the means are over
    clip_low_fraction:mean            ``r < 1 - clip_low`` (the PPO / CISPO lower bound binds)
    clip_high_fraction:mean           ``r > 1 + clip_high``
    kl_old:mean                       k3 estimate of KL(old || current):
                                      ``e^(old - lp) - (old - lp) - 1``
    kl_ref:mean                       the same against ``ref_logprobs`` (when sent)
    logprob_diff:mean / :max          ``|lp - old|``: the train/sampler log-prob mismatch per token
    sequence_ratio:mean / :max        ``exp(sum over a sequence's loss tokens of (lp - old))``,
                                      the sequence-level ratio (summed over CP before ``exp``)
    entropy:mean                      the predictive distribution's entropy (when computed)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from trainctl.workers.ops.loss import MAX_LOG_RATIO
from trainctl.workers.ops.metrics import Reduction, StatsTracker
from trainctl.workers.ops.sequence_loss import SequenceIndex


def policy_metric_keys(*, with_ref: bool, with_entropy: bool) -> list[tuple[str, Reduction]]:
    """Every ``(name, reduction)`` ``record_policy_metrics`` records, for
    ``StatsTracker.ensure``."""
    mean, low, high = Reduction.MEAN, Reduction.MIN, Reduction.MAX
    keys = [
        ("ratio", mean), ("ratio", low), ("ratio", high),
        ("clip_low_fraction", mean), ("clip_high_fraction", mean), ("kl_old", mean),
        ("logprob_diff", mean), ("logprob_diff", high),
        ("sequence_ratio", mean), ("sequence_ratio", high),
        ("loss_tokens", Reduction.SUM), ("loss_sequences", Reduction.SUM),
    ]  # fmt: skip
    if with_ref:
        keys.append(("kl_ref", mean))
    if with_entropy:
        keys.append(("entropy", mean))
    return keys


def record_policy_metrics(
    tracker: StatsTracker,
    logprobs: Tensor,
    *,
    loss_mask: Tensor,
    old_logprobs: Tensor,
    seq_id: Tensor,
    num_seqs: int,
    cp_group: ProcessGroup | None,
    clip_low: float,
    clip_high: float,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> None:
    """Record one micro-batch's policy metrics (``[T]`` tensors of this rank's tokens; the
    caller skips dummies). Per-sequence sums are all-reduced over ``cp_group`` first."""
    lp = logprobs.detach().double()
    mask = loss_mask > 0
    delta = torch.where(mask, lp - old_logprobs.double(), torch.zeros_like(lp))
    ratio = delta.clamp(max=MAX_LOG_RATIO).exp()
    tracker.denominator(loss_tokens=mask)
    tracker.stat(denominator="loss_tokens", ratio=ratio)
    tracker.stat(denominator="loss_tokens", reduction=Reduction.MIN, ratio=ratio)
    tracker.stat(denominator="loss_tokens", reduction=Reduction.MAX, ratio=ratio)
    tracker.stat(
        denominator="loss_tokens",
        clip_low_fraction=(ratio < 1.0 - clip_low).double(),
        clip_high_fraction=(ratio > 1.0 + clip_high).double(),
        kl_old=_k3(-delta),
        logprob_diff=delta.abs(),
    )
    tracker.stat(denominator="loss_tokens", reduction=Reduction.MAX, logprob_diff=delta.abs())
    if ref_logprobs is not None:
        d = torch.where(mask, ref_logprobs.double() - lp, torch.zeros_like(lp))
        tracker.stat(denominator="loss_tokens", kl_ref=_k3(d))
    if entropy is not None:
        tracker.stat(denominator="loss_tokens", entropy=entropy)
    # Sequence level: sum(lp - old) per sequence, summed over CP before exp.
    index = SequenceIndex(seq_id, num_seqs, cp_group)
    total, counts = index.sums(delta, mask)
    has = counts > 0
    seq_ratio = total.clamp(max=MAX_LOG_RATIO).exp()
    # Each CP rank holds every sequence's reduced value: count it on CP rank 0 only.
    first = index.first_holder()
    seqs = has & first
    tracker.denominator(loss_sequences=seqs)
    tracker.stat(denominator="loss_sequences", sequence_ratio=seq_ratio)
    tracker.stat(denominator="loss_sequences", reduction=Reduction.MAX, sequence_ratio=seq_ratio)


def _k3(d: Tensor) -> Tensor:
    """``e^d - d - 1`` with ``d = log(q / p)``: an unbiased, non-negative KL(p || q) estimate."""
    d = d.clamp(max=MAX_LOG_RATIO)
    return d.exp() - d - 1.0
