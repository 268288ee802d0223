"""MoE routing replay: tokens go through the experts a sampler chose, not the trainer's own.

A sampler and a trainer route some tokens to different experts (other kernels, other batch
shapes, a policy that moved), so their log-probs disagree. With ``routed_experts`` given, every
router takes those top-k experts in forward and backward (recomputation included), and its
probabilities are its own scores at them, so it still learns. Checked here:
* the routes the trainer reports equal the given ones, before and after the weights move;
  without replay they differ (the fraction is printed);
* the router gets a gradient; replay changes the log-probs;
* ep2, tp2 (sequence parallel), dp2 x ep2, pp2 with full recomputation, and tree packing give
  one rank's log-probs, loss, gradients and parameters (1e-5) and the same reported routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helpers.batches import ragged_batch, shared_batch
from helpers.layouts import full_tensors
from helpers.rankpool import RankPool
from replay_cases import random_routes, replay_case

MOE = {
    "num_layers": 2,
    "max_seq_len": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "num_experts": 4,
    "moe_topk": 2,
    "moe_ffn_hidden_size": 64,
}
RTOL = 1e-5


def _cfg(recompute: str = "none", **layout: int) -> dict:
    return {
        "layout": layout,
        "max_tokens_per_microbatch": 96,
        "model": MOE,
        "optimizer": {"clip_grad": 0.0, "eps": 1e-5, "lr": 1e-2},
        "recompute": recompute,
    }


def _routes(batch: list[dict]) -> list[np.ndarray]:
    return random_routes(batch, layers=MOE["num_layers"], experts=MOE["num_experts"],
                         top_k=MOE["moe_topk"])  # fmt: skip


def _merged(results: list[dict], key: str, batch: list[dict]) -> tuple[dict, list[np.ndarray]]:
    """The log-probs (from the reporting rank) and the routes (every rank's pieces)."""
    from trainctl.workers.control.results import merge_routes

    parts = [r[key] for r in results]
    lps = {i: lp for p in parts for i, (lp, _) in p.per_sequence.items()}
    routes = merge_routes(parts, [len(s["tokens"]) for s in batch], MOE["num_layers"])
    return lps, routes


def _as_sets(routes: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(r, axis=2) for r in routes]


def _differ(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The fraction of (token, layer) whose expert sets differ."""
    diff = [(x != y).any(axis=2) for x, y in zip(_as_sets(a), _as_sets(b), strict=True)]
    return float(np.concatenate([d.ravel() for d in diff]).mean())


@pytest.fixture(scope="module")
def single(pools: Callable[[int], RankPool]) -> Callable[[str], list[dict]]:
    cache: dict[str, list[dict]] = {}

    def get(packing: str) -> list[dict]:
        if packing not in cache:
            batch = ragged_batch() if packing == "flat" else shared_batch()
            cache[packing] = pools(1).run(replay_case, _cfg(), batch, _routes(batch), packing)
        return cache[packing]

    return get


def test_replayed_routes_hold_after_the_weights_move(single: Callable[[str], list[dict]]) -> None:
    batch = ragged_batch()
    given = _routes(batch)
    (r,) = single("flat")
    own_lp, own = _merged([r], "own_before", batch)
    lp, before = _merged([r], "replayed_before", batch)
    _, after = _merged([r], "replayed_after", batch)
    _, own_after = _merged([r], "own_after", batch)
    for got in (before, after):
        for g, want in zip(_as_sets(got), _as_sets(given), strict=True):
            np.testing.assert_array_equal(g, want)
    before_frac, after_frac = _differ(own, given), _differ(own_after, given)
    print(
        "without replay, the trainer's routes differ from the given ones on "
        f"{before_frac:.1%} of (token, layer) before the step, {after_frac:.1%} after"
    )
    assert before_frac > 0.3 and after_frac > 0.3
    assert _differ(own, own_after) > 0.0, "the step moved no route: the weights did not move"
    assert r["router_grad_norm"] > 0.0
    gap = max(float(np.abs(lp[i] - own_lp[i]).max()) for i in lp)
    assert gap > 1e-4, "replaying other experts changed no log-prob"


LAYOUTS: list[tuple[dict[str, Any], str, str]] = [
    ({"ep": 2, "dp": 2}, "none", "flat"),
    ({"tp": 2}, "none", "flat"),
    ({"dp": 2, "ep": 2, "tp": 2}, "none", "flat"),
    ({"pp": 2}, "full", "flat"),
    ({"dp": 2}, "none", "tree"),
]


@pytest.mark.parametrize(
    ("layout", "recompute", "packing"),
    LAYOUTS,
    ids=["-".join(f"{k}{v}" for k, v in lay.items()) + f"-{rc}-{pk}" for lay, rc, pk in LAYOUTS],
)
def test_replay_matches_one_rank(
    pools: Callable[[int], RankPool],
    single: Callable[[str], list[dict]],
    layout: dict,
    recompute: str,
    packing: str,
) -> None:
    batch = ragged_batch() if packing == "flat" else shared_batch()
    reference = single(packing)
    world = int(np.prod([v for k, v in layout.items() if k != "ep"]))
    results = pools(world).run(
        replay_case, _cfg(recompute, **layout), batch, _routes(batch), packing
    )
    for key in ("replayed_before", "replayed_after", "own_before"):
        want_lp, want_routes = _merged(reference, key, batch)
        got_lp, got_routes = _merged(results, key, batch)
        assert sorted(got_lp) == sorted(want_lp) == list(range(len(batch)))
        for i in want_lp:
            np.testing.assert_allclose(got_lp[i], want_lp[i], rtol=RTOL, atol=1e-6, err_msg=key)
        for g, w in zip(_as_sets(got_routes), _as_sets(want_routes), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=key)
        if key.startswith("replayed"):
            for g, w in zip(_as_sets(got_routes), _as_sets(_routes(batch)), strict=True):
                np.testing.assert_array_equal(g, w, err_msg=key)
    (ref,) = reference
    for r in results:
        if r["is_last_stage"]:
            assert abs(r["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (r["loss"], ref["loss"])
        assert np.isclose(r["grad_norm"], ref["grad_norm"], rtol=RTOL), r["grad_norm"]
    for key, floor in (("grads", RTOL), ("params", None)):
        got, want = full_tensors(results, key), full_tensors(reference, key)
        assert got.keys() == want.keys()
        for n, w in want.items():
            # Near-zero gradient elements: 1e-5 of their tensor's largest; parameters: 1% of
            # one Adam step (lr 1e-2), as the layout matrix holds them.
            atol = floor * float(np.abs(w).max()) if floor else 1e-4
            np.testing.assert_allclose(got[n], w, rtol=RTOL, atol=atol, err_msg=f"{key} {n}")
