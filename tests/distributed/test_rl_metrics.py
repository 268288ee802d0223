"""The RL metrics (workers/ops/rl_metrics.py) of a PPO pass: equal to a float64 computation
from the per-token log-probs of the same weights, and the same on dp2, cp2 and dp2 x cp2 as
on one rank (1e-6 relative): means are sums over sums, sequence ratios are summed over CP
before exp, and every rank joins every reduction."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from helpers.batches import ragged_batch
from helpers.layouts import engine_cfg, layout_id, world_size
from helpers.rankpool import RankPool
from split_cases import policy_metrics_case


def _k3(d: np.ndarray) -> np.ndarray:
    return np.exp(d) - d - 1.0


def reference(batch: list[dict], lps: dict[int, np.ndarray], ents: dict[int, np.ndarray]) -> dict:
    """The metrics in float64 from each sequence's log-probs: position t of a sequence is a
    loss token when loss_mask[t] = 1 and t > 0."""
    r, kl_old, kl_ref, diff, ent, seq_r = [], [], [], [], [], []
    for i, s in enumerate(batch):
        m = np.asarray(s["loss_mask"], bool).copy()
        m[0] = False
        if not m.any():
            continue
        lp = lps[i].astype(np.float64)[m]
        old = np.asarray(s["old_logprobs"], np.float64)[m]
        ref = np.asarray(s["ref_logprobs"], np.float64)[m]
        d = lp - old
        r.append(np.exp(d))
        kl_old.append(_k3(-d))
        kl_ref.append(_k3(ref - lp))
        diff.append(np.abs(d))
        ent.append(ents[i].astype(np.float64)[m])
        seq_r.append(np.exp(d.sum()))
    ratio = np.concatenate(r)
    return {
        "ratio:mean": ratio.mean(), "ratio:min": ratio.min(), "ratio:max": ratio.max(),
        "clip_low_fraction:mean": (ratio < 0.8).mean(),
        "clip_high_fraction:mean": (ratio > 1.28).mean(),
        "kl_old:mean": np.concatenate(kl_old).mean(),
        "kl_ref:mean": np.concatenate(kl_ref).mean(),
        "logprob_diff:mean": np.concatenate(diff).mean(),
        "logprob_diff:max": np.concatenate(diff).max(),
        "entropy:mean": np.concatenate(ent).mean(),
        "sequence_ratio:mean": np.mean(seq_r), "sequence_ratio:max": np.max(seq_r),
        "loss_tokens:sum": float(ratio.size), "loss_sequences:sum": float(len(seq_r)),
    }  # fmt: skip


def _metrics(results: list[dict]) -> dict[str, float]:
    got = [r["metrics"] for r in results if r["is_last_stage"]]
    assert all(g == got[0] for g in got)  # every rank reports the same values
    return got[0]


@pytest.fixture(scope="module")
def single(pools: Callable[[int], RankPool]) -> list[dict]:
    return pools(1).run(policy_metrics_case, engine_cfg(), ragged_batch())


def test_metrics_equal_a_float64_reference(single: list[dict]) -> None:
    (r,) = single
    want = reference(ragged_batch(), r["logprobs"], r["entropy"])
    got = _metrics(single)
    for key, value in want.items():
        assert key in got, key
        # Log-probs round to fp32 before the reference sees them; e^(sum of ~30) amplifies.
        assert abs(got[key] - value) <= 1e-5 * max(abs(value), 1e-3), (key, got[key], value)
    assert 0 < got["clip_low_fraction:mean"] + got["clip_high_fraction:mean"] < 1


@pytest.mark.parametrize("layout", [{"dp": 2}, {"cp": 2}, {"dp": 2, "cp": 2}], ids=layout_id)
def test_metrics_are_the_same_on_every_layout(
    pools: Callable[[int], RankPool], single: list[dict], layout: dict
) -> None:
    want = _metrics(single)
    got = _metrics(
        pools(world_size(layout)).run(policy_metrics_case, engine_cfg(**layout), ragged_batch())
    )
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-6 * max(abs(value), 1.0), (key, got[key], value)
