"""The loss a step computes: its kind, its normalisation and their options.

Each kind names one function of the engine's loss table (``workers/ops/loss.py``); a test
keeps the two in step.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossKind(str, Enum):
    """Per-token loss terms (``lp`` = log p of the target under the current policy)."""

    CROSS_ENTROPY = "cross_entropy"
    """``-lp``: supervised / SFT."""
    IMPORTANCE_SAMPLING = "importance_sampling"
    """``-exp(lp - old_lp) * A``: policy gradient corrected for the behaviour policy."""
    PPO = "ppo"
    """``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` with ``r = exp(lp - old_lp)``."""
    CISPO = "cispo"
    """``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * lp * A``: the clipped ratio weights the
    log-prob's gradient and is not differentiated (MiniMax-M1). ``clip_low`` / ``clip_high``
    are distances from 1 (epsilons), as for PPO."""
    DRO = "dro"
    """``-(lp * A - beta / 2 * (lp - old_lp)^2)``: policy gradient with a quadratic penalty on
    the drift from the sampler's log-probs (``old_logprobs``)."""


class Normalization(str, Enum):
    """How the summed per-token terms are divided, computed once for the global batch."""

    TOKEN_MEAN = "token_mean"
    """Divide by the number of loss tokens in the whole batch."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences (with a loss token) of each sequence's token mean."""
    SUM = "sum"
    """No division."""


class LossConfig(BaseModel):
    """Which loss the step computes. The normaliser is computed once on the global batch."""

    model_config = ConfigDict(extra="forbid")

    kind: LossKind = LossKind.CROSS_ENTROPY
    normalization: Normalization = Normalization.TOKEN_MEAN
    clip_low: float = Field(0.2, ge=0, le=1, description="PPO: lower ratio bound 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO: upper ratio bound 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference policy.")
    beta: float = Field(
        0.0, ge=0, description="DRO: weight of the quadratic penalty beta / 2 * (lp - old_lp)^2."
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Truncated importance sampling: each policy term times "
        "min(exp(old_logprobs - sampler_logprobs), tis_cap), correcting the train/sampler "
        "mismatch (needs sampler_logprobs; not for cross_entropy).",
    )

    @model_validator(mode="after")
    def _tis_needs_a_policy_loss(self) -> LossConfig:
        if self.tis_cap is not None and self.kind is LossKind.CROSS_ENTROPY:
            raise ValueError("tis_cap corrects a policy loss; cross_entropy has no ratio to cap")
        return self

    def required_inputs(self) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if self.kind is not LossKind.CROSS_ENTROPY:
            out += ("advantages", "old_logprobs")
        if self.kl_coef > 0:
            out += ("ref_logprobs",)
        if self.tis_cap is not None:
            out += ("sampler_logprobs",)
        return out

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``workers/ops/loss.py:per_token_terms`` for this loss (the
        normalisation is not among them: the host folds it into each token's loss scale)."""
        return {
            "kind": self.kind.value,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "kl_coef": self.kl_coef,
            "beta": self.beta,
            "tis_cap": self.tis_cap,
        }
