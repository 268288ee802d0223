"""GSPO native against GSPO as a Tinker custom loss, on every parallel layout
(docs/algorithms.md §16).

Tinker's ``forward_backward_custom`` takes the log-probs, computes a loss from them on the
client, and trains with ``weights = -dL/dlogprobs`` on a cross-entropy sum. Here the loss is
GSPO exactly as Tinker's loss page writes it (float64, one sequence at a time, from the log-probs
this layout computes), and native ``gspo`` on the same layout must give the same loss and the
same gradients (1e-6 relative). A sequence split over CP ranks or laid out in a prefix trie gets
one ratio only through the per-sequence all-reduce: without it, dp2 x cp2 fails. The same
check through the real SDK: tests/service/test_tinker_sdk.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from helpers.batches import ragged_batch, shared_batch, with_sampler
from helpers.layouts import engine_cfg, full_tensors, layout_id, world_size
from helpers.rankpool import RankPool
from sequence_cases import gspo_native_and_weighted, logprobs_case

CLIP = 0.05


def tinker_gspo(
    batch: list[dict], logprobs: dict[int, np.ndarray], clip: float
) -> tuple[float, list[list[float]]]:
    """Tinker's GSPO summed over the batch, and its gradient with respect to each token's
    log-prob, as per-token weights (``-dL/dlp``; 0 at position 0, which predicts nothing)."""
    total = torch.zeros((), dtype=torch.float64)
    leaves = []
    for i, s in enumerate(batch):
        lp = torch.tensor(logprobs[i][1:], dtype=torch.float64, requires_grad=True)
        leaves.append(lp)
        q = torch.tensor(s["old_logprobs"][1:], dtype=torch.float64)
        adv = torch.tensor(s["advantages"][1:], dtype=torch.float64)
        weights = torch.tensor(s["loss_mask"][1:], dtype=torch.float64)
        if "weights" in s:  # Tinker's weights: the loss mask times the per-token weights
            weights = weights * torch.tensor(s["weights"][1:], dtype=torch.float64)
        in_ratio = torch.tensor(s["sequence_ratio_mask"][1:]) != 0
        if not in_ratio.any():
            continue
        log_ratio = (lp.detach() - q)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
        total = total - (torch.minimum(ratio * adv, clipped * adv) * weights).sum()
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    weights_out = [
        [0.0, *(np.zeros(len(s["tokens"]) - 1) if g is None else -g.numpy()).tolist()]
        for s, g in zip(batch, grads, strict=True)
    ]
    return float(total), weights_out


CASES = [
    ({"dp": 2, "cp": 2}, "flat"),
    ({"tp": 2, "pp": 2}, "flat"),
    ({"dp": 2, "cp": 2}, "tree"),
]


@pytest.mark.parametrize(
    ("layout", "packing"), CASES, ids=[f"{layout_id(lay)}-{p}" for lay, p in CASES]
)
def test_native_gspo_equals_tinkers_formula_as_a_custom_loss(
    pools: Callable[[int], RankPool], layout: dict, packing: str
) -> None:
    batch = with_sampler(shared_batch() if packing == "tree" else ragged_batch())
    cfg = engine_cfg(**layout)
    pool = pools(world_size(layout))
    logprobs: dict[int, np.ndarray] = {}
    for part in pool.run(logprobs_case, cfg, batch, packing):
        logprobs.update(part)
    assert sorted(logprobs) == list(range(len(batch)))
    want_loss, weights = tinker_gspo(batch, logprobs, CLIP)
    results = pool.run(gspo_native_and_weighted, cfg, batch, weights, CLIP, packing)
    if packing == "tree":
        assert sum(r["tree_microbatches"] for r in results) > 0
    for r in results:
        if r["is_last_stage"]:
            assert r["native_loss"] == pytest.approx(want_loss, rel=1e-6, abs=1e-6)
    native, weighted = full_tensors(results, "native"), full_tensors(results, "weighted")
    assert native.keys() == weighted.keys()
    for name, g in weighted.items():
        scale = float(np.abs(g).max())
        assert scale > 0, name
        np.testing.assert_allclose(native[name], g, rtol=1e-6, atol=1e-6 * scale, err_msg=name)
