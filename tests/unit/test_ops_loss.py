"""Losses, dummy micro-batches and the stats tracker on one rank (docs/algorithms.md §7:
T1.12, T2.1, T2.3, T2.4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainctl.api.models import LossConfig, LossKind
from trainctl.workers.ops.loss import LOSS_KINDS, connected_zero, local_loss, per_token_terms
from trainctl.workers.ops.metrics import Reduction, StatsTracker
from trainctl.workers.ops.sequence_loss import SequenceIndex


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16))


def test_t2_1_dummy_keeps_graph() -> None:
    model = _model()
    out = model(torch.zeros(5, dtype=torch.long))
    connected_zero(out).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.shape == p.shape and torch.count_nonzero(p.grad) == 0, name


def test_t2_4_empty_output_not_nan() -> None:
    out = torch.empty(0, 16, requires_grad=True)
    loss = connected_zero(out)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert torch.isnan(out.mean() * 0.0)  # the upstream form this avoids
    loss.backward()


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = 12
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    return {
        "logprobs": lp,
        "loss_mask": (torch.rand(n, generator=g) > 0.3).double(),
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "old_logprobs": lp.detach() + 0.4 * torch.randn(n, generator=g, dtype=torch.float64),
        "ref_logprobs": lp.detach() + 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
    }


def test_loss_terms_match_their_formulas() -> None:
    x = _inputs()
    lp, m, a, old, ref = (
        x[k] for k in ("logprobs", "loss_mask", "advantages", "old_logprobs", "ref_logprobs")
    )
    kw = {k: v for k, v in x.items() if k != "logprobs"}
    r = (lp - old).exp()
    want = {
        LossKind.CROSS_ENTROPY: -lp,
        LossKind.IMPORTANCE_SAMPLING: -r * a,
        LossKind.PPO: torch.maximum(-r * a, -r.clamp(0.8, 1.28) * a),
        LossKind.CISPO: -r.clamp(0.8, 1.28).detach() * lp * a,
        LossKind.DRO: -(lp * a - 0.5 * 0.3 * (lp - old) ** 2),
    }
    for kind, w in want.items():
        spec = LossConfig(kind=kind, clip_low=0.2, clip_high=0.28, kl_coef=0.1, beta=0.3)
        got = per_token_terms(lp, **spec.options(), **kw)
        k3 = (ref - lp).exp() - (ref - lp) - 1
        want_k = (w + 0.1 * k3) * m
        torch.testing.assert_close(got, want_k)
        # The gradients too: CISPO's clipped ratio is a constant weight, DRO's penalty pulls
        # lp back toward the sampler's log-prob.
        (g,) = torch.autograd.grad(got.sum(), lp, retain_graph=True)
        (gw,) = torch.autograd.grad(want_k.sum(), lp, retain_graph=True)
        torch.testing.assert_close(g, gw)
    g_cispo = torch.autograd.grad(
        per_token_terms(lp, **LossConfig(kind=LossKind.CISPO).options(), **kw).sum(), lp
    )[0]
    torch.testing.assert_close(g_cispo, -r.detach().clamp(0.8, 1.2) * a * m)
    # Truncated importance sampling: the policy term times the capped behaviour ratio (a
    # constant), the KL term untouched.
    sampler = old + 0.3 * torch.randn(
        old.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    w = (old - sampler).exp().clamp(max=1.5)
    spec = LossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.28, kl_coef=0.1, tis_cap=1.5)
    got = per_token_terms(lp, **spec.options(), **kw, sampler_logprobs=sampler)
    k3 = (ref - lp).exp() - (ref - lp) - 1
    policy = torch.maximum(-r * a, -r.clamp(0.8, 1.28) * a)
    torch.testing.assert_close(got, (policy * w + 0.1 * k3) * m)
    assert (w == 1.5).any() and (w < 1.5).any()  # the cap binds somewhere, not everywhere
    # The weight is a constant: no gradient flows through the behaviour ratio.
    (g,) = torch.autograd.grad(got.sum(), lp, retain_graph=True)
    (gw,) = torch.autograd.grad(((policy * w.detach() + 0.1 * k3) * m).sum(), lp, retain_graph=True)
    torch.testing.assert_close(g, gw)
    assert spec.required_inputs() == (
        "advantages", "old_logprobs", "ref_logprobs", "sampler_logprobs",
    )  # fmt: skip
    with pytest.raises(ValueError, match="no ratio to correct"):
        LossConfig(tis_cap=2.0)
    spec = LossConfig(kind=LossKind.PPO)
    assert spec.required_inputs() == ("advantages", "old_logprobs")
    with pytest.raises(ValueError, match="needs advantages"):
        per_token_terms(lp, **spec.options(), loss_mask=m)


def test_masked_positions_never_overflow() -> None:
    lp = torch.tensor([-200.0, -1.0], requires_grad=True)
    zeros = torch.zeros(2)
    terms = per_token_terms(
        lp,
        **LossConfig(kind=LossKind.PPO, kl_coef=1.0).options(),
        loss_mask=torch.tensor([0.0, 1.0]),
        advantages=torch.ones(2),
        old_logprobs=zeros,
        ref_logprobs=zeros,
    )
    local_loss(terms, torch.tensor([0.0, 1.0])).backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0] == 0


def test_t2_3_stats_never_see_empty_tensors() -> None:
    t = StatsTracker()
    with pytest.raises(ValueError, match="non-empty"):
        t.denominator(valid=torch.zeros(0, dtype=torch.bool))
    t.denominator(valid=torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="non-empty"):
        t.stat(denominator="valid", loss=torch.zeros(0))


def test_tracker_reductions() -> None:
    t = StatsTracker()
    mask = torch.tensor([True, False, True, True])
    t.denominator(valid=mask)
    v = torch.tensor([1.0, 100.0, 3.0, -2.0])
    t.stat(denominator="valid", loss=v)
    t.stat(denominator="valid", reduction=Reduction.MIN, logprob=v)
    t.stat(denominator="valid", reduction=Reduction.MAX, logprob=v)
    t.scalar("sequences", 2)
    t.scalar("sequences", 3)
    out = t.export()
    assert out == {
        "valid:sum": 3.0,
        "loss:mean": 2 / 3,
        "logprob:min": -2.0,
        "logprob:max": 3.0,
        "sequences:sum": 5.0,
    }
    assert t.export() == {}


def test_scalar_mean_counts_each_record_once() -> None:
    t = StatsTracker()
    t.scalar("kl", 1.0, Reduction.MEAN)
    t.scalar("kl", 3.0, Reduction.MEAN)
    assert t.export() == {"kl:mean": 2.0}


def test_t1_12_single_key_export() -> None:
    t = StatsTracker()
    t.denominator(valid=torch.tensor([True, True]))
    t.scalar("tokens", 7)  # a SUM key without a denominator
    assert t.export(key="tokens:sum") == {"tokens:sum": 7.0}
    assert t.export() == {"valid:sum": 2.0}  # the other key is still there, the first is gone


def test_per_sequence_sums_single_rank() -> None:
    nll = torch.tensor([0.9, 0.3, 0.3, 2.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq_id = torch.tensor([0, 0, 0, 1])
    total, counts = SequenceIndex(seq_id, 2, None).sums(nll, mask)
    assert counts.tolist() == [3.0, 0.0]
    assert abs(float(total[0] / counts[0]) - 0.5) < 1e-12 and float(total[1]) == 0.0


def test_ensure_adds_identities_and_keeps_what_was_recorded() -> None:
    """A rank with only dummies still exports every key (as the reduction's identity), so its
    collectives match its peers'; a key that was recorded keeps its value."""
    t = StatsTracker()
    t.denominator(n=torch.tensor([True, True]))
    t.stat(denominator="n", reduction=Reduction.MAX, x=torch.tensor([1.0, 3.0]))
    keys = [("x", Reduction.MAX), ("x", Reduction.MIN), ("y", Reduction.SUM), ("z", Reduction.MEAN)]
    t.ensure(keys)
    out = t.export()
    assert out["x:max"] == 3.0 and out["x:min"] == float("inf") and out["y:sum"] == 0.0
    assert out["z:mean"] != out["z:mean"]  # 0 / 0: nothing recorded anywhere is NaN
    assert out["n:sum"] == 2.0


def test_the_loss_table_is_the_wire_enum() -> None:
    """Every ``LossKind`` the API accepts has its function, and no function lacks a kind;
    every kind computes through ``per_token_terms`` (none falls through to the error)."""
    assert set(LOSS_KINDS) == {k.value for k in LossKind}
    assert len(LOSS_KINDS) == len(set(LOSS_KINDS))
    x = _inputs()
    for kind in LossKind:
        # gspo's per-token ratio needs the whole sequence: here one sequence of all positions
        extra = (
            {"seq_log_ratio": x["logprobs"] - x["old_logprobs"]} if kind is LossKind.GSPO else {}
        )
        terms = per_token_terms(**x, **LossConfig(kind=kind).options(), **extra)
        assert terms.shape == x["logprobs"].shape and torch.isfinite(terms).all(), kind
