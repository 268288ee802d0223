"""The optimizer phase's pieces on plain tensors: fused AdamW stays fused through a checkpoint
saved by foreach AdamW, and its update is foreach's; the norm plan's value; the device-side
clip."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from trainctl.workers.engine.optim_phase import NormPlan, clip_, use_fused_adamw


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((7, 5), (5,), (3, 3, 2))]


def _step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_fused_adamw_survives_a_foreach_checkpoint_and_makes_foreachs_update() -> None:
    ref, ours = _params(0), _params(0)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    wrapped = SimpleNamespace(optimizer=torch.optim.AdamW(ours, lr=1e-2, foreach=True))
    use_fused_adamw(wrapped)
    for i in range(3):
        _step(ref, ref_opt, i)
        _step(ours, wrapped.optimizer, i)
    # A checkpoint written by foreach AdamW (its flags, its host step counters) loads back...
    wrapped.optimizer.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    groups = wrapped.optimizer.param_groups
    assert all(g["fused"] and not g["foreach"] for g in groups), groups
    for state in wrapped.optimizer.state.values():
        assert state["step"].dtype == torch.float32
    for i in range(3, 6):
        _step(ref, ref_opt, i)
        _step(ours, wrapped.optimizer, i)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-8)


def test_norm_plan_counts_dense_and_experts_apart_and_skips_the_rest() -> None:
    g = torch.Generator().manual_seed(1)
    dense, expert, skipped = (torch.randn(n, generator=g) for n in (10, 6, 4))
    plan = NormPlan.build(
        [(dense, "dense"), (expert, "experts"), (skipped, "none"), (torch.zeros(0), "dense")],
        torch.device("cpu"),
        key=(),
    )
    d, e = plan.squares()
    torch.testing.assert_close(d, dense.double().pow(2).sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(e, expert.double().pow(2).sum(), rtol=1e-6, atol=0)
    assert len(plan.views) == 2


def test_clip_scales_only_above_the_bound_and_exactly_by_one_below() -> None:
    buf = torch.randn(100)
    before = buf.clone()
    clip_([buf], torch.tensor(0.5, dtype=torch.float64), 1.0)
    assert torch.equal(buf, before)
    clip_([buf], torch.tensor(4.0, dtype=torch.float64), 1.0)
    torch.testing.assert_close(buf, before * (1.0 / (4.0 + 1e-6)), rtol=1e-7, atol=0)
