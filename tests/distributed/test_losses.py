"""CISPO, DRO and PPO with truncated importance sampling (CP-local losses, §1.5), and the
sequence-level ones (§16: GSPO, seq-TIS, seq-MIS, geometric-mean masking): on dp2 x cp2 and
tp2 x pp2 the eval loss, train loss, gradients, grad norm and parameters after the step equal
the single rank's (1e-5), as do the sequence-level metrics, and prefix-trie packing equals flat.
Their formulas against float64 references: tests/unit/test_ops_loss.py and
test_ops_sequence_loss.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_cases import step_and_collect
from helpers.batches import ragged_batch, shared_batch, with_sampler
from helpers.layouts import assert_same_step, engine_cfg, layout_id, world_size
from helpers.rankpool import RankPool

NEW_LOSSES = (
    ("cispo", "token_mean", {"clip_low": 0.2, "clip_high": 0.28}),
    # with seq-MIS: a sequence whose behaviour ratio leaves [0.3, 3] is left out
    ("dro", "seq_mean_token_mean", {"beta": 0.5, "seq_mis_low": 0.3, "seq_mis_high": 3.0}),
    # Truncated importance sampling on PPO: the capped behaviour ratio per token.
    ("ppo", "token_mean", {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 1.2}),
    # Sequence level: a sequence split over CP ranks or laid out in a trie gets one ratio.
    (
        "gspo",
        "seq_mean_token_mean",
        {"clip_low": 0.1, "clip_high": 0.1, "geo_mask_low": 0.97, "geo_mask_high": 1.03},
    ),
    ("importance_sampling", "token_mean", {"seq_tis_cap": 1.5}),
)
SEQUENCE_METRICS = ("gspo_ratio:mean", "gspo_ratio:max", "behaviour_sequence_ratio:mean",
                    "masked_sequence_fraction:mean")  # fmt: skip


KINDS = tuple(k for k, _, _ in NEW_LOSSES)  # one row each: results are kept by kind


def assert_same_sequence_metrics(results: list[dict], reference: list[dict]) -> None:
    """The sequence-level metrics of every last-stage rank equal the single rank's; the
    masking bands mask some sequences and keep others (or the comparison says little)."""
    (ref,) = reference
    for kind in KINDS:
        want = ref["per_loss"][kind]["eval_metrics"]
        for r in results:
            if not r["is_last_stage"]:
                continue
            got = r["per_loss"][kind]["eval_metrics"]
            for key in SEQUENCE_METRICS:
                assert (key in got) == (key in want), (kind, key)
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-5), (kind, key)
    masked = [
        ref["per_loss"][k]["eval_metrics"].get("masked_sequence_fraction:mean") for k in KINDS
    ]
    assert any(m is not None and 0 < m < 1 for m in masked), masked


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
    assert_same_sequence_metrics(results, reference)


def test_new_losses_tree_equals_flat(pools: Callable[[int], RankPool]) -> None:
    flat = pools(1).run(step_and_collect, engine_cfg(), with_sampler(shared_batch()), NEW_LOSSES)
    tree = pools(2).run(
        step_and_collect, engine_cfg(dp=2), with_sampler(shared_batch()), NEW_LOSSES, None, "tree"
    )
    assert sum(r["tree_microbatches"] for r in tree) > 0
    assert_same_step(tree, flat, KINDS)
    assert_same_sequence_metrics(tree, flat)
