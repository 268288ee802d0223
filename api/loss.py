"""The loss a step computes: its kind, its normalisation and their options.

Each kind names one function of the engine's loss table (``workers/ops/loss.py``); a test
keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
    GSPO = "gspo"
    """GSPO-token (Zheng et al. 2025, as Tinker defines it): PPO's clipped term, with every
    token's ratio taking its sequence's value ``s = exp(mean(lp - old_lp))`` over the tokens
    ``sequence_ratio_mask`` marks (default: the loss tokens) and its own log-prob's gradient:
    ``s_t = sg(s) * p_t / sg(p_t)``. A sequence split over ranks gets the same ``s``."""


@dataclass(frozen=True)
class LossSpec:
    """One loss kind's row in ``LOSSES``: everything the API, the engine and the Tinker layer
    need to know of it. Its formula is the function of the same name in
    ``workers/ops/loss.py`` (marked ``@policy_loss``). Adding a kind is its member in
    ``LossKind``, its row here and that function; nothing else changes."""

    policy: bool
    """A policy-gradient loss: it reads ``advantages`` and ``old_logprobs``, and takes the
    behaviour corrections (``tis_cap``, seq-TIS/MIS, geometric-mean masking) and
    ``kl_coef``."""
    knobs: tuple[str, ...] = ()
    """The ``LossConfig`` fields its formula reads besides those (Tinker's
    ``loss_fn_config`` keys follow from them)."""
    sequence_ratio: bool = False
    """Every token's ratio is its sequence's: one value per sequence over its
    ``sequence_ratio_mask`` (default: its loss tokens), summed over the CP ranks, reported as
    the ``<kind>_ratio`` metric. Its term of a token reads the whole sequence, so the LM head
    cannot take its gradient in its forward pass."""


_CLIPS = ("clip_low", "clip_high")
LOSSES: dict[LossKind, LossSpec] = {
    LossKind.CROSS_ENTROPY: LossSpec(policy=False),
    LossKind.IMPORTANCE_SAMPLING: LossSpec(policy=True),
    LossKind.PPO: LossSpec(policy=True, knobs=_CLIPS),
    LossKind.CISPO: LossSpec(policy=True, knobs=_CLIPS),
    LossKind.DRO: LossSpec(policy=True, knobs=("beta",)),
    LossKind.GSPO: LossSpec(policy=True, knobs=_CLIPS, sequence_ratio=True),
}
"""The registry of loss kinds: one row each."""


UNPUBLISHED_LOSSES = {
    "stable_reinforce": "its objective is not published, so trainctl cannot compute it as "
    "Tinker does; the nearest losses trainctl computes are 'gspo' (a clipped sequence-level "
    "ratio) and 'importance_sampling'",
}
"""Loss names other services use that trainctl refuses on purpose, with the reason."""


class Normalization(str, Enum):
    """How the summed per-token terms are divided, computed once for the global batch."""

    TOKEN_MEAN = "token_mean"
    """Divide by the number of loss tokens in the whole batch."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences (with a loss token) of each sequence's token mean."""
    SUM = "sum"
    """No division."""


_CORRECTIONS = (
    "tis_cap", "seq_tis_cap", "seq_mis_low", "seq_mis_high", "geo_mask_low", "geo_mask_high"
)  # fmt: skip
"""The behaviour corrections, each off when None."""


class LossConfig(BaseModel):
    """Which loss the step computes. The normaliser is computed once on the global batch.
    Every number is finite (a bound left out is the way to have none)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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

    seq_tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Sequence-level truncated importance sampling: each sequence's policy terms "
        "times min(exp(sum over its loss tokens of old_logprobs - sampler_logprobs), "
        "seq_tis_cap) (needs sampler_logprobs).",
    )
    seq_mis_low: float | None = Field(
        default=None,
        ge=0,
        description="Sequence-level masked importance sampling: a sequence whose ratio "
        "exp(sum of old_logprobs - sampler_logprobs) is below this is left out of the loss; "
        "the others are weighted by it (default 0 when seq_mis_high is set).",
    )
    seq_mis_high: float | None = Field(
        default=None,
        gt=0,
        description="Sequence-level masked importance sampling: a sequence whose ratio is "
        "above this is left out of the loss (default: no upper bound when seq_mis_low is set).",
    )
    geo_mask_low: float | None = Field(
        default=None,
        ge=0,
        description="Geometric-mean masking: a sequence whose geometric-mean ratio "
        "exp(mean of old_logprobs - sampler_logprobs) over its loss tokens is below this is "
        "left out of the loss (unweighted otherwise).",
    )
    geo_mask_high: float | None = Field(
        default=None,
        gt=0,
        description="Geometric-mean masking: a sequence whose geometric-mean ratio is above "
        "this is left out of the loss.",
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _not_unpublished(cls, kind: Any) -> Any:
        if isinstance(kind, str) and kind in UNPUBLISHED_LOSSES:
            raise ValueError(f"{kind!r}: {UNPUBLISHED_LOSSES[kind]}")
        return kind

    @model_validator(mode="after")
    def _corrections_need_a_policy_loss(self) -> LossConfig:
        corrections = [k for k in _CORRECTIONS if getattr(self, k) is not None]
        if corrections and not self.spec.policy:
            raise ValueError(
                f"{corrections[0]} corrects a policy loss; {self.kind.value} has no ratio to "
                "correct"
            )
        weighting = [k for k in ("tis_cap", "seq_tis_cap", "seq_mis") if self._on(k)]
        if len(weighting) > 1:
            raise ValueError(
                f"{weighting[0]} and {weighting[1]} both reweight by the behaviour ratio: choose "
                "one (geo_mask_low / geo_mask_high combine with either)"
            )
        for name in ("seq_mis", "geo_mask"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if low is not None and high is not None and not low < high:
                raise ValueError(f"{name}_low ({low}) must be below {name}_high ({high})")
        return self

    def _on(self, name: str) -> bool:
        if name in ("seq_mis", "geo_mask"):
            return any(getattr(self, f"{name}_{end}") is not None for end in ("low", "high"))
        return getattr(self, name) is not None

    def band(self, name: str) -> tuple[float, float] | None:
        """``(low, high)`` of ``seq_mis`` or ``geo_mask`` (None when off; an open end is 0 or
        ``inf``)."""
        if not self._on(name):
            return None
        low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
        return (low or 0.0, float("inf") if high is None else high)

    @property
    def spec(self) -> LossSpec:
        """This kind's row of ``LOSSES``."""
        return LOSSES[self.kind]

    @property
    def sequence_correction(self) -> bool:
        """Whether a sequence-level behaviour correction (seq-TIS, seq-MIS, geometric-mean
        masking) is on."""
        return self.seq_tis_cap is not None or self._on("seq_mis") or self._on("geo_mask")

    def required_inputs(self) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if self.spec.policy:
            out += ("advantages", "old_logprobs")
        if self.kl_coef > 0:
            out += ("ref_logprobs",)
        if self.tis_cap is not None or self.sequence_correction:
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
            "sequence_ratio": self.spec.sequence_ratio,
        }
