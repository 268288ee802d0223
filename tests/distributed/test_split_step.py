"""The split step (docs/algorithms.md §11): several ``forward_backward`` parts, then one
``optim_step``, equal one ``train_batch`` of the union of the data - gradients, grad norm and
parameters after the step, for each normalisation - at dp2 x cp2, where reducing after every
part would count the first part dp x cp times (at dp1 that mistake is invisible). A part rolled
back leaves the sum as it was."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine_cases import step_and_collect
from helpers.batches import ragged_batch
from helpers.layouts import LR, RTOL, engine_cfg, full_tensors
from helpers.rankpool import RankPool
from split_cases import rollback_twice_case, split_step_case

CASES = [
    ("cross_entropy", "token_mean", {}),
    ("importance_sampling", "seq_mean_token_mean", {}),
    ("ppo", "sum", {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.05}),
]


@pytest.mark.parametrize("loss", CASES, ids=[n for _, n, _ in CASES])
def test_parts_then_one_step_equal_one_train_batch(
    pools: Callable[[int], RankPool], loss: tuple
) -> None:
    batch = ragged_batch()
    cfg = engine_cfg()
    if loss[1] == "sum":
        # Unnormalised, the gradients (and their fp32 rounding) are ~N = 190 loss tokens
        # larger; Adam's step near g = 0 moves by lr * dg / eps, so eps grows with them to
        # keep the parameter check at 1% of a step (test_engine_layouts.assert_same_step).
        cfg["optimizer"] = {**cfg["optimizer"], "eps": 2e-3}
    union = pools(1).run(step_and_collect, cfg, batch, (loss,))
    parts = [batch[:3], batch[3:]]
    split_cfg = {**engine_cfg(dp=2, cp=2), "optimizer": cfg["optimizer"]}
    split = pools(4).run(split_step_case, split_cfg, parts, loss)
    (ref,) = union
    want = ref["per_loss"][loss[0]]
    for r in split:
        assert abs(r["grad_norm"] - want["grad_norm"]) <= RTOL * want["grad_norm"], (
            r["grad_norm"],
            want["grad_norm"],
        )
    got = full_tensors([{**r, "per_loss": {"x": r}} for r in split], "grads", "x")
    ref_grads = full_tensors(union, "shard_grads", loss[0])
    assert got.keys() == ref_grads.keys() and got
    for name, g in ref_grads.items():
        atol = RTOL * float(np.abs(g).max())
        np.testing.assert_allclose(got[name], g, rtol=RTOL, atol=atol, err_msg=name)
    params = full_tensors(split, "params")
    for name, p in full_tensors(union, "shard_params").items():
        np.testing.assert_allclose(params[name], p, rtol=RTOL, atol=1e-2 * LR, err_msg=name)
    # Per-token losses, gathered over CP by the reporting ranks: every sequence of each part
    # once, summing to the part's loss (Tinker's elementwise_loss).
    for i, part in enumerate(parts):
        merged: dict[int, list[float]] = {}
        for r in split:
            merged.update(r["token_losses"][i])
        assert sorted(merged) == list(range(len(part)))
        assert [len(v) for v in merged.values()] == [len(part[k]["tokens"]) for k in merged]
        total, want_loss = sum(map(sum, merged.values())), split[0]["part_losses"][i]
        assert abs(total - want_loss) <= 1e-5 * abs(want_loss), (total, want_loss)


def test_a_part_undone_twice_leaves_the_window_as_before_it(
    pools: Callable[[int], RankPool],
) -> None:
    for r in pools(2).run(rollback_twice_case, engine_cfg(dp=2)):
        assert r == {"same": True, "parts": 1, "nonzero": True}
