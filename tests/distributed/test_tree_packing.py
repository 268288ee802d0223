"""Prefix-trie packing changes nothing but the cost (docs/algorithms.md §10): on every layout it
supports, a batch with shared prefixes packed as tries gives the same eval loss, train loss,
gradients, grad norm and parameters after the step as the same batch packed flat on one rank,
for every loss the engine has (different advantages on shared tokens); the same per-token
log-probs; and it computes fewer tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine_cases import logprobs_and_grads, step_and_collect
from helpers.batches import shared_batch
from helpers.layouts import (
    LAYOUTS,
    LOSSES,
    MOE,
    assert_same_step,
    engine_cfg,
    layout_id,
    world_size,
)
from helpers.rankpool import RankPool

# The engine's layout matrix up to 4 ranks, and one rank.
TREE_LAYOUTS = [{}, *(layout for layout in LAYOUTS if world_size(layout) <= 4)]


@pytest.fixture(scope="module")
def flat_reference(pools: Callable[[int], RankPool]) -> list[dict]:
    return pools(1).run(step_and_collect, engine_cfg(), shared_batch(), LOSSES)


def _tree(results: list[dict]) -> None:
    """The tries were used, and they computed fewer tokens than the flat batch has."""
    assert sum(r["tree_microbatches"] for r in results) > 0
    r = results[0]
    assert 0 < r["computed_tokens"] < r["flat_tokens"]


@pytest.mark.parametrize("layout", TREE_LAYOUTS, ids=lambda d: layout_id(d) or "dp1")
def test_tree_equals_flat(
    pools: Callable[[int], RankPool], flat_reference: list[dict], layout: dict
) -> None:
    results = pools(world_size(layout)).run(
        step_and_collect, engine_cfg(**layout), shared_batch(), LOSSES, None, "tree"
    )
    _tree(results)
    assert_same_step(results, flat_reference)


def test_tree_equals_flat_for_moe(pools: Callable[[int], RankPool]) -> None:
    """Routing is per token: experts see each shared token once, and the step is the same."""
    cfg = {**engine_cfg(), "model": MOE}
    want = pools(1).run(step_and_collect, cfg, shared_batch(), LOSSES)
    for layout in ({"dp": 2, "ep": 2}, {"tp": 2}):
        cfg = {**engine_cfg(**layout), "model": MOE}
        got = pools(2).run(step_and_collect, cfg, shared_batch(), LOSSES, None, "tree")
        _tree(got)
        assert_same_step(got, want)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-ep2"])
def test_a_rank_with_only_dummies(pools: Callable[[int], RankPool], moe: bool) -> None:
    """One GRPO group is one trie: at dp2 the second rank gets no real micro-batch, only a
    dummy, and the step still equals one rank's; its stats (the MoE routing counts, reduced
    over every rank) are those of the real tokens."""
    batch = shared_batch(groups=("grpo",))
    extra = {"model": MOE} if moe else {}
    want = pools(1).run(step_and_collect, {**engine_cfg(), **extra}, batch, LOSSES)
    layout = {"dp": 2, "ep": 2} if moe else {"dp": 2}
    got = pools(2).run(
        step_and_collect, {**engine_cfg(**layout), **extra}, batch, LOSSES, None, "tree"
    )
    assert sorted(r["real_microbatches"] for r in got) == [0, 1]
    _tree(got)
    assert_same_step(got, want)
    for r in got:
        for kind, res in r["per_loss"].items():
            assert all(np.isfinite(v) for v in res["eval_metrics"].values()), kind
        if moe:  # the first eval: each trie token routed once, to top-k experts, every layer
            routed = r["per_loss"]["cross_entropy"]["eval_metrics"]["moe_routed:sum"]
            assert routed == r["computed_tokens"] * MOE["moe_topk"] * MOE["num_layers"]


@pytest.mark.parametrize(
    "layout", [{}, {"cp": 2}, {"tp": 2}, {"pp": 2}], ids=["dp1", "cp2", "tp2", "pp2"]
)
def test_tree_logprobs_equal_flat(pools: Callable[[int], RankPool], layout: dict) -> None:
    batch = shared_batch()
    world = world_size(layout)
    flat = pools(world).run(logprobs_and_grads, engine_cfg(**layout), batch)
    tree = pools(world).run(logprobs_and_grads, engine_cfg(**layout), batch, "tree")
    for key in ("logprobs", "entropy"):
        got = {i: v for r in tree for i, v in r[key].items()}
        want = {i: v for r in flat for i, v in r[key].items()}
        assert sorted(got) == sorted(want) == list(range(len(batch)))
        for i in want:
            np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-6, err_msg=f"{key} {i}")
