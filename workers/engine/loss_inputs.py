"""A micro-batch's loss inputs on the last stage (``LossInputs``), among them the sequence-level
ones: GSPO's per-token ratio and the sequence-level behaviour corrections (seq-TIS, seq-MIS,
geometric-mean masking), with their metrics (``SequenceTerms``).

The math is ``workers/ops/sequence_loss.py``; this object reads a ``LossConfig`` and one
micro-batch's per-token inputs, and keeps what the metrics need until they are recorded.
The corrections read only inputs (old and sampler log-probs), so they are ready before the
output layer runs; GSPO's ratio reads the log-probs, so it comes after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from trainctl.api.models import LossConfig
from trainctl.workers.engine.inputs import RankMicroBatch
from trainctl.workers.ops.metrics import Reduction, StatsTracker
from trainctl.workers.ops.sequence_loss import (
    Band,
    BehaviourCorrection,
    BehaviourWeights,
    GspoRatio,
    SequenceIndex,
    behaviour_weights,
    gspo_log_ratio,
)

RATIO_MASK = "sequence_ratio_mask"


def sequence_metric_keys(loss: LossConfig) -> list[tuple[str, Reduction]]:
    """The metrics ``SequenceTerms.record`` records for ``loss`` (the same on every rank)."""
    mean, low, high = Reduction.MEAN, Reduction.MIN, Reduction.MAX
    keys: list[tuple[str, Reduction]] = []
    if loss.spec.sequence_ratio:
        name = ratio_metric(loss)
        keys += [(name, mean), (name, low), (name, high)]
    if loss.sequence_correction:
        keys += [
            ("behaviour_sequence_ratio", mean), ("behaviour_sequence_ratio", high),
            ("behaviour_geometric_ratio", mean), ("masked_sequence_fraction", mean),
        ]  # fmt: skip
    return keys


def _correction(loss: LossConfig) -> BehaviourCorrection:
    mis, geo = loss.band("seq_mis"), loss.band("geo_mask")
    return BehaviourCorrection(
        tis_cap=loss.seq_tis_cap,
        mis_band=None if mis is None else Band(*mis),
        geo_band=None if geo is None else Band(*geo),
    )


class SequenceTerms:
    """One micro-batch's sequence-level loss inputs; built with the per-token loss inputs,
    from which it takes the ratio mask (``per_token_terms`` does not read it). Owns the
    per-sequence values until ``record`` hands them to the metrics."""

    def __init__(
        self, loss: LossConfig, per_token: dict[str, Tensor], loss_mask: Tensor, seqs: SequenceIndex
    ) -> None:
        self.loss, self.seqs, self.loss_mask = loss, seqs, loss_mask
        self.ratio_mask = per_token.pop(RATIO_MASK, None)
        self.behaviour: BehaviourWeights | None = None
        self.gspo: GspoRatio | None = None
        if loss.sequence_correction:
            self.behaviour = behaviour_weights(
                per_token["old_logprobs"], per_token["sampler_logprobs"], loss_mask, seqs,
                _correction(loss), dtype=per_token["old_logprobs"].dtype,
            )  # fmt: skip

    def before_head(self) -> dict[str, Tensor]:
        """The extra ``per_token_terms`` inputs that do not read the log-probs."""
        return {} if self.behaviour is None else {"seq_weight": self.behaviour.weight}

    def after_head(self, logprobs: Tensor, per_token: dict[str, Any]) -> dict[str, Tensor]:
        """Every extra ``per_token_terms`` input, given the micro-batch's log-probs."""
        out = self.before_head()
        if self.loss.spec.sequence_ratio:
            mask = self.loss_mask if self.ratio_mask is None else self.ratio_mask
            self.gspo = gspo_log_ratio(logprobs, per_token["old_logprobs"], mask, self.seqs)
            out["seq_log_ratio"] = self.gspo.log_ratio
        return out

    def record(self, stats: StatsTracker) -> None:
        """The per-sequence metrics, over the sequences with a loss token (counted on one CP
        rank). Uses the ``loss_sequences`` denominator ``record_policy_metrics`` registered for
        this micro-batch, so it runs right after it."""
        if self.gspo is not None:
            r = {ratio_metric(self.loss): self.gspo.sequence_ratio}
            for reduction in (Reduction.MEAN, Reduction.MIN, Reduction.MAX):
                stats.stats(r, denominator="loss_sequences", reduction=reduction)
        if self.behaviour is not None:
            b = self.behaviour
            stats.stat(
                denominator="loss_sequences",
                behaviour_sequence_ratio=b.sequence_ratio,
                behaviour_geometric_ratio=b.geometric_ratio,
                masked_sequence_fraction=b.masked.double(),
            )
            stats.stat(
                denominator="loss_sequences",
                reduction=Reduction.MAX,
                behaviour_sequence_ratio=b.sequence_ratio,
            )


def needs_sequence_terms(loss: LossConfig) -> bool:
    return loss.spec.sequence_ratio or loss.sequence_correction


def ratio_metric(loss: LossConfig) -> str:
    """The metric of a sequence-ratio loss's per-sequence ratio: ``gspo_ratio`` for gspo."""
    return f"{loss.kind.value}_ratio"


@dataclass(frozen=True)
class LossInputs:
    """A real micro-batch's loss inputs on the last stage: the per-token ones
    ``per_token_terms`` reads, the loss scale, the sequence index and the sequence-level
    terms (None unless the loss has some)."""

    per_token: dict[str, Tensor]
    scale: Tensor
    seqs: SequenceIndex
    sequence: SequenceTerms | None

    @classmethod
    def of(cls, mb: RankMicroBatch, loss: LossConfig, cp_group: Any) -> LossInputs:
        b = mb.batch
        assert b.loss_mask is not None
        per_token = {k: v[0] for k, v in b.loss_inputs.items()}
        scale = per_token.pop("loss_scale")
        seqs = SequenceIndex(per_token.pop("seq_id").long(), mb.num_sequences, cp_group)
        sequence = None
        if needs_sequence_terms(loss):
            sequence = SequenceTerms(loss, per_token, b.loss_mask[0], seqs)
        else:
            per_token.pop(RATIO_MASK, None)
        return cls(per_token, scale, seqs, sequence)

    def before_head(self) -> dict[str, Tensor]:
        return {} if self.sequence is None else self.sequence.before_head()

    def after_head(self, logprobs: Tensor) -> dict[str, Tensor]:
        if self.sequence is None:
            return {}
        return self.sequence.after_head(logprobs, self.per_token)
