"""Per-token losses reduced CP-locally against a global normaliser (ALGORITHMS.md §1.5, §2).

Each rank sums its own tokens' loss terms and divides by ``N``, the global count of loss tokens
computed once on the host. The sum of the local losses over all DP x CP ranks is then exactly
the global token mean, so the gradient sync must *sum* (not average) over DP x CP.
"""

from __future__ import annotations

from torch import Tensor


def connected_zero(output: Tensor) -> Tensor:
    """A zero loss whose gradient reaches every parameter that produced ``output``.

    ``sum() * 0`` rather than ``mean() * 0``: the mean of an empty tensor is NaN.
    """
    return output.sum() * 0.0


def token_sum_nll(logprobs: Tensor, loss_weight: Tensor, *, normalizer: float) -> Tensor:
    """Cross-entropy term of this rank: ``-sum(w * log p) / N`` (a scalar)."""
    return -(logprobs * loss_weight).sum() / normalizer
