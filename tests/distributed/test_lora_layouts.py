"""LoRA layout invariance: an adapter on a frozen base gives, on every layout, the eval loss,
train loss, adapter gradients, grad norm and parameters after a step of one rank (fp32, 1e-5
relative), with the PPO loss (the losses' own layout invariance is the full model's tests')
and through tree packing: the TP rules of ``workers/ops/lora.py``
(column, row, fused q/k/v, gate/up, the merged LM head) and the TP sum of the replicated factor
under sequence parallelism."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_cases import step_and_collect
from helpers.batches import ragged_batch, shared_batch
from helpers.layouts import (
    LOSSES,
    MODEL,
    MOE,
    STARVE_EP1,
    assert_same_step,
    engine_cfg,
    full_tensors,
    layout_id,
    world_size,
)
from helpers.rankpool import RankPool

ADAPTER = {"name": "a", "rank": 4, "alpha": 8.0, "targets": ["attn", "mlp", "unembed"], "seed": 7}
"""Rank 4 inside sites 8 wide: the padding must stay exactly zero."""
LORA = {"max_adapters": 2, "max_rank": 8}
PPO = LOSSES[-1:]
"""One loss, the one with the most parts (ratios, clipping, KL): it also steps."""
ONLY = (PPO[0][0],)


def _lora_cfg(model: dict = MODEL, **layout: int) -> dict:
    return {**engine_cfg(**layout), "model": model, "lora": LORA}


@pytest.fixture(scope="module")
def reference(pools: Callable[[int], RankPool]) -> list[dict]:
    return pools(1).run(step_and_collect, _lora_cfg(), ragged_batch(), PPO, None, "flat", ADAPTER)


LAYOUTS = [
    {"dp": 2},
    {"tp": 2},  # with sequence parallelism (the default at tp > 1)
    {"pp": 2},
    {"cp": 2},
    {"dp": 2, "cp": 2},
    {"tp": 2, "pp": 2},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_adapter_matches_single_rank(
    pools: Callable[[int], RankPool], reference: list[dict], layout: dict
) -> None:
    results = pools(world_size(layout)).run(
        step_and_collect, _lora_cfg(**layout), ragged_batch(), PPO, None, "flat", ADAPTER
    )
    assert_same_step(results, reference, losses=ONLY)
    grads = full_tensors(results, "shard_grads", ONLY[0])
    # Only the adapter has gradients: every site's two factors, the base none.
    assert grads and all(n.endswith((".lora_a", ".lora_b")) for n in grads)
    assert any(n.startswith("output_layer.") for n in grads)


def test_tp_without_sequence_parallelism(
    pools: Callable[[int], RankPool], reference: list[dict]
) -> None:
    cfg = {**_lora_cfg(tp=2), "sequence_parallel": "off"}
    results = pools(2).run(step_and_collect, cfg, ragged_batch(), PPO, None, "flat", ADAPTER)
    assert_same_step(results, reference, losses=ONLY)


def test_tree_packing_matches_flat(pools: Callable[[int], RankPool]) -> None:
    batch = shared_batch()
    flat = pools(1).run(step_and_collect, _lora_cfg(), batch, PPO, None, "flat", ADAPTER)
    tree = pools(4).run(step_and_collect, _lora_cfg(dp=2, tp=2), batch, PPO, None, "tree", ADAPTER)
    assert any(r["tree_microbatches"] for r in tree)
    # A LoRA A-gradient sums x * dz over every token, with much cancellation: the tries'
    # other summation order (and the thread count's matmul blocking) moved one element of
    # 1024 by 8.6e-9 in a CI run, 1.6e-5 of the tensor's largest. Elements are held to 1e-4
    # of it here; the losses, norms and parameters keep 1e-5.
    assert_same_step(tree, flat, losses=ONLY, grad_floor=1e-4)


MOE_LAYOUTS = [
    ({"dp": 2, "ep": 2}, None),
    # Experts 2 and 3 (EP rank 1's) get no tokens: their factors' gradients are full-shape
    # zeros, so DDP's buckets still fill on that rank.
    ({"dp": 2, "ep": 2}, STARVE_EP1),
    # SP: each TP rank routes its own tokens through whole experts; the experts' factors are
    # summed over the expert-data-parallel group (TP included), as the experts' weights are.
    ({"tp": 2, "ep": 2}, None),
]


@pytest.mark.parametrize(
    ("layout", "offsets"), MOE_LAYOUTS, ids=["dp2ep2", "dp2ep2-starved", "tp2ep2"]
)
def test_moe_adapter_on_experts(
    pools: Callable[[int], RankPool], layout: dict, offsets: list[float] | None
) -> None:
    """MoE: every expert's fc1 and fc2 take the adapter, with attention and the LM head."""
    ref = pools(1).run(
        step_and_collect, _lora_cfg(MOE), ragged_batch(), PPO, offsets, "flat", ADAPTER
    )
    got = pools(world_size(layout)).run(
        step_and_collect, _lora_cfg(MOE, **layout), ragged_batch(), PPO, offsets,
        "flat", ADAPTER,
    )  # fmt: skip
    assert_same_step(got, ref, losses=ONLY)
    grads = full_tensors(got, "shard_grads", ONLY[0])
    experts = {n for n in grads if ".local_experts." in n}
    # Every expert (by its global index) and both linears: fc1 and fc2, A and B.
    assert len(experts) == MOE["num_experts"] * 2 * 2 * MOE["num_layers"]
    # The experts' factors are in the graph: B (nonzero after the warm-up step) has gradients.
    assert any(float(abs(grads[n]).max()) > 0 for n in experts if n.endswith(".lora_b"))
