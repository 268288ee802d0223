"""CISPO, DRO and PPO with truncated importance sampling (CP-local losses, §1.5): on dp2 x cp2 and
tp2 x pp2 the eval loss, train loss, gradients, grad norm and parameters after the step equal
the single rank's (1e-5), and prefix-trie packing equals flat. Their formulas against float64
references: tests/unit/test_ops_loss.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine_cases import step_and_collect
from helpers.batches import ragged_batch, shared_batch
from helpers.layouts import assert_same_step, engine_cfg, layout_id, world_size
from helpers.rankpool import RankPool

NEW_LOSSES = (
    ("cispo", "token_mean", {"clip_low": 0.2, "clip_high": 0.28}),
    ("dro", "seq_mean_token_mean", {"beta": 0.5}),
    # Truncated importance sampling on PPO: the capped behaviour ratio per token.
    ("ppo", "token_mean", {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 1.2}),
)


def with_sampler(batch: list[dict], seed: int = 3) -> list[dict]:
    """The batch plus the inference engine's log-probs, off the behaviour log-probs."""
    rng = np.random.default_rng(seed)
    return [
        {
            **s,
            "sampler_logprobs": (
                np.asarray(s["old_logprobs"]) + rng.normal(0, 0.3, len(s["tokens"]))
            ).tolist(),
        }
        for s in batch
    ]


KINDS = tuple(k for k, _, _ in NEW_LOSSES)


@pytest.fixture(scope="module")
def reference(pools: Callable[[int], RankPool]) -> list[dict]:
    return pools(1).run(step_and_collect, engine_cfg(), with_sampler(ragged_batch()), NEW_LOSSES)


@pytest.mark.parametrize("layout", [{"dp": 2, "cp": 2}, {"tp": 2, "pp": 2}], ids=layout_id)
def test_new_losses_match_single_rank(
    pools: Callable[[int], RankPool], reference: list[dict], layout: dict
) -> None:
    results = pools(world_size(layout)).run(
        step_and_collect, engine_cfg(**layout), with_sampler(ragged_batch()), NEW_LOSSES
    )
    assert_same_step(results, reference, KINDS)


def test_new_losses_tree_equals_flat(pools: Callable[[int], RankPool]) -> None:
    flat = pools(1).run(step_and_collect, engine_cfg(), with_sampler(shared_batch()), NEW_LOSSES)
    tree = pools(2).run(
        step_and_collect, engine_cfg(dp=2), with_sampler(shared_batch()), NEW_LOSSES, None, "tree"
    )
    assert sum(r["tree_microbatches"] for r in tree) > 0
    assert_same_step(tree, flat, KINDS)
