"""Sequence-level losses on one rank against float64 references written per sequence
(docs/algorithms.md §16): GSPO as Tinker's loss page writes it, seq-TIS, seq-MIS and
geometric-mean masking. Every layout against this one rank: tests/distributed/test_losses.py
and tests/distributed/test_sequence_losses.py."""

from __future__ import annotations

import pytest
import torch

from trainctl.api.models import LossConfig, LossKind
from trainctl.workers.ops.loss import per_token_terms
from trainctl.workers.ops.sequence_loss import (
    Band,
    BehaviourCorrection,
    SequenceIndex,
    behaviour_weights,
    gspo_log_ratio,
)

LENGTHS = (5, 9, 4, 7)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four packed sequences: per-position float64 inputs, a loss mask, a ratio mask that
    marks part of each sequence's loss tokens, and ``seq_id``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    seq_id = torch.cat([torch.full((k,), i) for i, k in enumerate(LENGTHS)])
    loss_mask = (torch.rand(n, generator=g) > 0.2).double()
    ratio_mask = loss_mask * (torch.rand(n, generator=g) > 0.3).double()
    for i in range(len(LENGTHS)):  # every sequence keeps a ratio token
        first = int((seq_id == i).nonzero()[0])
        loss_mask[first] = ratio_mask[first] = 1.0
    old = lp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    return {
        "logprobs": lp,
        "old_logprobs": old,
        "sampler_logprobs": old + 0.3 * torch.randn(n, generator=g, dtype=torch.float64),
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "loss_mask": loss_mask,
        "ratio_mask": ratio_mask,
        "seq_id": seq_id,
    }


def _tinker_gspo(x: dict[str, torch.Tensor], low: float, high: float) -> torch.Tensor:
    """Tinker's GSPO, one sequence at a time: the mean log-ratio over the ratio tokens, each
    token carrying its value with its own log-prob's gradient, PPO's clip; summed over the
    loss tokens."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(LENGTHS)):
        at = x["seq_id"] == i
        lp, q, a = x["logprobs"][at], x["old_logprobs"][at], x["advantages"][at]
        in_ratio = x["ratio_mask"][at] != 0
        log_ratio = (lp.detach() - q)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped = ratio.clamp(low, high)
        total = total - (torch.minimum(ratio * a, clipped * a) * x["loss_mask"][at]).sum()
    return total


def _native_gspo(x: dict[str, torch.Tensor], clip_low: float, clip_high: float) -> torch.Tensor:
    seqs = SequenceIndex(x["seq_id"], len(LENGTHS), None)
    gspo = gspo_log_ratio(x["logprobs"], x["old_logprobs"], x["ratio_mask"], seqs)
    spec = LossConfig(kind=LossKind.GSPO, clip_low=clip_low, clip_high=clip_high)
    terms = per_token_terms(
        x["logprobs"], **spec.options(), loss_mask=x["loss_mask"],
        advantages=x["advantages"], old_logprobs=x["old_logprobs"],
        seq_log_ratio=gspo.log_ratio,
    )  # fmt: skip
    return terms.sum()


def test_gspo_equals_tinkers_formula_in_value_and_gradient() -> None:
    x = _batch()
    want = _tinker_gspo(x, 0.95, 1.05)
    (g_want,) = torch.autograd.grad(want, x["logprobs"])
    got = _native_gspo(x, 0.05, 0.05)
    (g_got,) = torch.autograd.grad(got, x["logprobs"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
    # The clip binds on some sequences and not on others: a clipped, positive-advantage
    # sequence's tokens get no gradient, the others get ``-s * A``.
    seqs = SequenceIndex(x["seq_id"], len(LENGTHS), None)
    s = gspo_log_ratio(x["logprobs"], x["old_logprobs"], x["ratio_mask"], seqs).sequence_ratio
    assert ((s < 0.95) | (s > 1.05)).any() and ((s >= 0.95) & (s <= 1.05)).any(), s
    # A token's ratio is its sequence's, not its own: with token ratios the value differs.
    token_level = LossConfig(kind=LossKind.PPO, clip_low=0.05, clip_high=0.05)
    ppo = per_token_terms(
        x["logprobs"], **token_level.options(), loss_mask=x["loss_mask"],
        advantages=x["advantages"], old_logprobs=x["old_logprobs"],
    ).sum()  # fmt: skip
    assert abs(float((ppo - want).detach())) > 1e-3


def test_gspo_is_a_sequence_ratio_loss_and_needs_its_ratio() -> None:
    """The fused head's in-forward loss reads one chunk of tokens at a time: a sequence-ratio
    loss stays out (``schedule.gradient_in_forward`` reads the registry row)."""
    assert LossConfig(kind=LossKind.GSPO).spec.sequence_ratio
    assert not LossConfig(kind=LossKind.PPO).spec.sequence_ratio
    x = _batch()
    with pytest.raises(ValueError, match="seq_log_ratio"):
        per_token_terms(
            x["logprobs"], **LossConfig(kind=LossKind.GSPO).options(), loss_mask=x["loss_mask"],
            advantages=x["advantages"], old_logprobs=x["old_logprobs"],
        )  # fmt: skip


def _reference_weights(x: dict[str, torch.Tensor], loss: LossConfig) -> torch.Tensor:
    """Per position, its sequence's weight, one sequence at a time in float64."""
    out = torch.zeros_like(x["old_logprobs"])
    for i in range(len(LENGTHS)):
        at = x["seq_id"] == i
        m = x["loss_mask"][at] != 0
        b = (x["old_logprobs"][at] - x["sampler_logprobs"][at])[m]
        ratio, geo = float(b.sum().exp()), float(b.mean().exp())
        w = 1.0
        if loss.seq_tis_cap is not None:
            w = min(ratio, loss.seq_tis_cap)
        mis = loss.band("seq_mis")
        if mis is not None:
            w = ratio if mis[0] <= ratio <= mis[1] else 0.0
        geo_band = loss.band("geo_mask")
        if geo_band is not None and not geo_band[0] <= geo <= geo_band[1]:
            w = 0.0
        out[at] = w
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"seq_tis_cap": 1.5},
        {"seq_mis_low": 0.5, "seq_mis_high": 2.0},
        {"geo_mask_low": 0.95, "geo_mask_high": 1.05},
        {"seq_tis_cap": 1.5, "geo_mask_high": 1.05},
    ],
    ids=["seq_tis", "seq_mis", "geo_mask", "seq_tis+geo_mask"],
)
def test_sequence_corrections_match_a_per_sequence_reference(options: dict[str, float]) -> None:
    x = _batch(seed=3)
    loss = LossConfig(kind=LossKind.PPO, **options)
    mis, geo = loss.band("seq_mis"), loss.band("geo_mask")
    correction = BehaviourCorrection(
        tis_cap=loss.seq_tis_cap,
        mis_band=None if mis is None else Band(*mis),
        geo_band=None if geo is None else Band(*geo),
    )
    seqs = SequenceIndex(x["seq_id"], len(LENGTHS), None)
    got = behaviour_weights(
        x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], seqs, correction,
        dtype=torch.float64,
    )  # fmt: skip
    want = _reference_weights(x, loss)
    torch.testing.assert_close(got.weight, want, rtol=1e-12, atol=1e-12)
    per_seq = torch.stack([want[x["seq_id"] == i][0] for i in range(len(LENGTHS))])
    # Not vacuous: the weights differ between sequences, and a masking band masks some.
    assert len(set(per_seq.tolist())) > 1, per_seq
    if mis or geo:
        assert 0 < int(got.masked.sum()) < len(LENGTHS), got.masked
    # The weight multiplies the policy term, a constant (no gradient through it).
    terms = per_token_terms(
        x["logprobs"], **loss.options(), loss_mask=x["loss_mask"], advantages=x["advantages"],
        old_logprobs=x["old_logprobs"], seq_weight=got.weight,
    )  # fmt: skip
    plain = per_token_terms(
        x["logprobs"], **loss.options(), loss_mask=x["loss_mask"], advantages=x["advantages"],
        old_logprobs=x["old_logprobs"],
    )  # fmt: skip
    torch.testing.assert_close(terms, plain * want)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seq_tis_cap": -1.0}, "greater than 0"),
        ({"seq_tis_cap": 2.0, "tis_cap": 2.0}, "both reweight"),
        ({"seq_tis_cap": 2.0, "seq_mis_high": 2.0}, "both reweight"),
        ({"seq_mis_low": 2.0, "seq_mis_high": 1.5}, "must be below"),
        ({"geo_mask_low": -0.1}, "greater than or equal to 0"),
    ],
)
def test_bad_corrections_are_refused_naming_the_option(
    options: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(kind=LossKind.PPO, **options)
    with pytest.raises(ValueError, match="corrects a policy loss"):
        LossConfig(seq_tis_cap=2.0)


def test_corrections_need_the_sampler_logprobs() -> None:
    spec = LossConfig(kind=LossKind.GSPO, geo_mask_high=1.1)
    assert spec.required_inputs() == ("advantages", "old_logprobs", "sampler_logprobs")
    assert LossConfig(kind=LossKind.GSPO).required_inputs() == ("advantages", "old_logprobs")
