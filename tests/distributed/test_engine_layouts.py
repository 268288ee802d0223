"""Layout invariance, the headline test: on every layout, the same seed model and the same
ragged batch give the same eval loss, train loss, gradients and grad norm as a single rank -
for cross-entropy, importance sampling and PPO with KL - and the same parameters after one
AdamW step (fp32, 1e-5 relative)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine_cases import logprobs_and_grads, recompute_case, step_and_collect, tied_embedding_case
from helpers.batches import ragged_batch
from helpers.layouts import (
    FAMILY_SHAPES,
    LAYOUTS,
    LOSSES,
    LR,
    MODEL,
    MOE,
    RTOL,
    STARVE_EP1,
    assert_same_step,
    engine_cfg,
    full_tensors,
    layout_id,
    world_size,
)
from helpers.rankpool import RankPool


@pytest.fixture(scope="module")
def reference(pools: Callable[[int], RankPool]) -> list[dict]:
    return pools(1).run(step_and_collect, engine_cfg(), ragged_batch(), LOSSES)


def assert_token_split(results: list[dict], layout: dict, *, sequence_parallel: bool) -> None:
    """Each rank's layers saw its CP shard of every micro-batch's tokens, split over the TP
    ranks under sequence parallelism (and whole without it)."""
    split = layout.get("cp", 1) * (layout.get("tp", 1) if sequence_parallel else 1)
    for r in results:
        assert r["microbatch_tokens"], r["coords"]
        assert r["norm_rows"] == [n // split for n in r["microbatch_tokens"]], r["coords"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_layout_matches_single_rank(
    pools: Callable[[int], RankPool], reference: list[dict], layout: dict
) -> None:
    results = pools(world_size(layout)).run(
        step_and_collect, engine_cfg(**layout), ragged_batch(), LOSSES
    )
    assert_same_step(results, reference)
    # Sequence parallelism is on wherever tp > 1 (the default).
    assert_token_split(results, layout, sequence_parallel=layout.get("tp", 1) > 1)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"cp": 2, "tp": 2}], ids=layout_id)
def test_tp_without_sequence_parallelism_matches_single_rank(
    pools: Callable[[int], RankPool], reference: list[dict], layout: dict
) -> None:
    """sequence_parallel off: every TP rank keeps all the tokens; the same numbers."""
    cfg = engine_cfg(sequence_parallel="off", **layout)
    results = pools(world_size(layout)).run(step_and_collect, cfg, ragged_batch(), LOSSES)
    assert_same_step(results, reference)
    assert_token_split(results, layout, sequence_parallel=False)


def _moe_cfg(**layout: int) -> dict:
    return {**engine_cfg(**layout), "model": MOE}


MOE_CASES = [
    ({"dp": 2, "ep": 2}, None),
    ({"dp": 2, "ep": 2}, STARVE_EP1),
    # tp2: sequence parallelism; each TP rank routes its own tokens through whole experts.
    ({"tp": 2}, None),
    # tp2 x ep2: the TP ranks hold different experts and exchange tokens.
    ({"tp": 2, "ep": 2}, None),
    ({"tp": 2, "ep": 2}, STARVE_EP1),
    ({"dp": 2, "tp": 2, "ep": 2}, None),
]


@pytest.fixture(scope="module")
def moe_reference(pools: Callable[[int], RankPool]) -> Callable[[list[float] | None], list[dict]]:
    cache: dict[tuple[float, ...] | None, list[dict]] = {}

    def get(offsets: list[float] | None) -> list[dict]:
        key = None if offsets is None else tuple(offsets)
        if key not in cache:
            cache[key] = pools(1).run(step_and_collect, _moe_cfg(), ragged_batch(), LOSSES, offsets)
        return cache[key]

    return get


@pytest.mark.parametrize(
    ("layout", "offsets"),
    MOE_CASES,
    ids=[layout_id(lay) + ("-ep1-gets-no-tokens" if o else "") for lay, o in MOE_CASES],
)
def test_moe_matches_single_rank(
    pools: Callable[[int], RankPool],
    moe_reference: Callable[[list[float] | None], list[dict]],
    layout: dict,
    offsets: list[float] | None,
) -> None:
    reference = moe_reference(offsets)
    results = pools(world_size(layout)).run(
        step_and_collect, _moe_cfg(**layout), ragged_batch(), LOSSES, offsets
    )
    assert_same_step(results, reference)
    assert_token_split(results, layout, sequence_parallel=layout.get("tp", 1) > 1)
    names = full_tensors(results, "shard_params")
    assert sum(".local_experts." in n for n in names) == 4 * MOE["num_layers"] * 2
    for r in results:
        for got in r["per_loss"].values():
            assert got["expert_grads_missing"] == []
            assert got["expert_modules"] == ["GroupedExperts"]
            load = got["eval_metrics"]
            assert load["moe_routed:sum"] > 0 and load["moe_load_max_over_mean:value"] >= 1.0
    if offsets is STARVE_EP1:
        for r in results:
            for kind, got in r["per_loss"].items():
                norm = got["local_expert_grad_norm"]
                if r["coords"]["ep"] == 1:
                    assert norm == 0.0, (kind, r["coords"])  # zero, full shape
                else:
                    assert norm > 0.0, (kind, r["coords"])


FAMILY_LAYOUTS = [{"dp": 2}, {"cp": 2}, {"tp": 2}, {"pp": 2}, {"dp": 2, "cp": 2}]
EXTRA = {
    "qwen2": ("linear_qkv.bias", MODEL["num_layers"]),
    "qwen3": ("q_layernorm.weight", MODEL["num_layers"]),
    "qwen3_5": ("self_attention.A_log", 3),
    "qwen3_5_moe": ("mlp.shared_experts.gate_weight", 4),
}
"""A tensor each family adds, and how many of it the model has."""


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_family_shapes_match_single_rank(pools: Callable[[int], RankPool], family: str) -> None:
    """The same matrix for a Qwen2-shaped (q/k/v biases, tied embeddings), a Qwen3-shaped
    (q/k norms, heads wider than hidden / heads) and a Qwen3.5-shaped model (Gated DeltaNet,
    gated attention; no CP, which its linear layers refuse), dense and MoE (routed experts and
    a gated shared expert; also at dp2 x ep2): the biases', norms', linear layers' and shared
    experts' gradients are summed right over TP, CP and DP, and at pp2 the tied embedding's
    gradient is the sum of the first and the last stage's, counted once in the grad norm."""

    def cfg(**layout: int) -> dict:
        return {**engine_cfg(**layout), "model": FAMILY_SHAPES[family]}

    reference = pools(1).run(step_and_collect, cfg(), ragged_batch(), LOSSES)
    names = full_tensors(reference, "shard_params")
    extra, count = EXTRA[family]
    assert sum(n.endswith(extra) for n in names) == count
    assert ("output_layer.weight" in names) == (family != "qwen2")
    moe = [{"dp": 2, "ep": 2}] if "moe" in family else []
    for layout in FAMILY_LAYOUTS + moe:
        if family.startswith("qwen3_5") and layout.get("cp", 1) > 1:
            continue
        results = pools(world_size(layout)).run(
            step_and_collect, cfg(**layout), ragged_batch(), LOSSES
        )
        assert_same_step(results, reference)


def test_tied_embeddings_at_pp2_live_once(pools: Callable[[int], RankPool]) -> None:
    """With pp2 the tied matrix lives on the first stage (embedding) and the last (output
    layer). After a step both copies are equal, bit for bit; the checkpoint holds it once (the
    first stage's) and a load restores the last stage's copy from it; the parameter count
    equals pp1's. (The gradient and the grad norm against pp1: the family matrix above.)"""
    model = FAMILY_SHAPES["qwen2"]
    one = pools(1).run(tied_embedding_case, {**engine_cfg(), "model": model}, ragged_batch())
    two = pools(2).run(tied_embedding_case, {**engine_cfg(pp=2), "model": model}, ragged_batch())
    first, last = sorted(two, key=lambda r: r["pp"])
    assert len(first["after_step"]) == len(last["after_step"]) == 1
    np.testing.assert_array_equal(first["after_step"][0], last["after_step"][0])
    np.testing.assert_allclose(
        first["after_step"][0], one[0]["after_step"][0], rtol=RTOL, atol=1e-2 * LR
    )
    assert first["checkpoint_names"] == ["embedding.word_embeddings.weight"]
    assert last["checkpoint_names"] == []
    np.testing.assert_array_equal(last["after_load"][0], first["after_step"][0])
    np.testing.assert_array_equal(first["after_load"][0], first["after_step"][0])
    assert first["num_parameters"] + last["num_parameters"] == one[0]["num_parameters"]
    assert "output_layer.weight" not in last["grad_norm_names"]


@pytest.mark.parametrize("layout", [{}, {"tp": 2}], ids=["tp1", "tp2"])
def test_fused_lm_head_changes_no_logprob(pools: Callable[[int], RankPool], layout: dict) -> None:
    """The fused LM head (logits a chunk of 32 tokens at a time) against all logits at once:
    per-token log-probs and entropies bit for bit, gradients within 1e-5 (the output layer's
    weight gradient sums the tokens chunk by chunk)."""

    def run(fused: bool) -> list[dict]:
        cfg = {**engine_cfg(**layout), "fused_lm_head": fused, "logprob_chunk_size": 32}
        return pools(world_size(layout)).run(logprobs_and_grads, cfg, ragged_batch())

    fused, unfused = run(True), run(False)
    for key in ("logprobs", "entropy"):
        got = {i: v for r in fused for i, v in r[key].items()}
        want = {i: v for r in unfused for i, v in r[key].items()}
        assert sorted(got) == sorted(want) and len(got) == len(ragged_batch())
        for i in want:
            np.testing.assert_array_equal(got[i], want[i], err_msg=f"{key} {i}")
    grads, ref = (
        full_tensors([{**r, "per_loss": {"x": r}} for r in rs], "grads", "x")
        for rs in (fused, unfused)
    )
    assert grads.keys() == ref.keys()
    for name, g in ref.items():
        atol = RTOL * float(np.abs(g).max())
        np.testing.assert_allclose(grads[name], g, rtol=RTOL, atol=atol, err_msg=name)


RECOMPUTED = {"norms": ("norm_forwards",), "elementwise": ("norm_forwards", "swiglu_forwards"),
              "selective": ("mlp_forwards", "swiglu_forwards"),
              "full": ("mlp_forwards", "norm_forwards", "swiglu_forwards")}  # fmt: skip
"""What each recompute mode runs again in backward, by ``recompute_case``'s counters."""
_KEPT: dict[str, list[dict]] = {}
"""``recompute: none``'s run of each layout, made once for every mode it is compared with."""


@pytest.mark.parametrize("mode", list(RECOMPUTED))
@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}], ids=["dp1", "tp2", "pp2"])
def test_recomputation_changes_no_number(
    pools: Callable[[int], RankPool], mode: str, layout: dict
) -> None:
    """Recomputed activations are the same activations: the loss and every gradient equal
    the run that keeps them, bit for bit (with the norms recomputed: to fp32's rounding); and
    what the mode recomputes (the norms, the SwiGLU products, the MLPs) really ran again in
    backward, and nothing else did."""

    def run(recompute: str) -> list[dict]:
        cfg = {**engine_cfg(**layout), "recompute": recompute}
        return pools(world_size(layout)).run(recompute_case, cfg, ragged_batch())

    key = layout_id(layout)
    got, want = run(mode), _KEPT.get(key) or _KEPT.setdefault(key, run("none"))
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == w["loss"]
        once = w["microbatches"] * w["local_layers"]
        for counter, per_layer in (
            ("mlp_forwards", 1),
            ("norm_forwards", 2),
            ("swiglu_forwards", 1),
        ):
            again = 2 if counter in RECOMPUTED[mode] else 1
            assert w[counter] == per_layer * once, (counter, w)
            assert g[counter] == again * per_layer * once, (counter, g)
    grads, ref = full_tensors(got, "grads"), full_tensors(want, "grads")
    assert grads.keys() == ref.keys()
    for name, g in ref.items():
        if mode in ("norms", "elementwise"):
            # The residual stream's gradient adds the norm's share inside the recompute's
            # backward, the rest outside it: the same terms summed in another order.
            atol = RTOL * float(np.abs(g).max())
            np.testing.assert_allclose(grads[name], g, rtol=RTOL, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(grads[name], g, err_msg=name)


@pytest.mark.parametrize(
    "layout", [{}, {"tp": 2}, {"dp": 2, "ep": 2}], ids=["dp1", "tp2", "dp2-ep2"]
)
def test_recomputed_expert_products_change_no_number(
    pools: Callable[[int], RankPool], layout: dict
) -> None:
    """``elementwise`` recomputes each expert's weighted SwiGLU (``silu(gate) * up * p``) on
    top of what ``norms`` recomputes: the loss and every gradient, the router's (through
    ``p``) and the experts', equal ``norms``' bit for bit."""

    def run(recompute: str) -> list[dict]:
        cfg = {**_moe_cfg(**layout), "recompute": recompute}
        return pools(world_size(layout)).run(recompute_case, cfg, ragged_batch())

    got, want = run("elementwise"), run("norms")
    assert [g["loss"] for g in got] == [w["loss"] for w in want]
    grads, ref = full_tensors(got, "grads"), full_tensors(want, "grads")
    assert grads.keys() == ref.keys()
    assert any(".router." in n for n in ref) and any(".local_experts." in n for n in ref)
    for name, g in ref.items():
        np.testing.assert_array_equal(grads[name], g, err_msg=name)
