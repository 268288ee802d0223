"""The train step's cost does not hide in its structure: attention's bytes are linear in the
tokens whatever the number of sequences, no host read of a tensor interrupts forward/backward,
the gradient norm is a few dispatched ops whatever the parameter count, and the fused AdamW
makes the update foreach AdamW made. Counted on the CPU by the dispatcher, so CI holds the
GPU step to them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import step_cost_cases as cases
from helpers.layouts import full_tensors
from helpers.rankpool import RankPool


def test_attention_backward_bytes_are_linear_in_the_tokens(
    pools: Callable[[int], RankPool],
) -> None:
    """The same 512 tokens as one sequence and as 8 of 64: the backward writes within 10% of
    the same bytes per token (per-sequence slicing wrote a full-size zero gradient per slice:
    +18% at 8 sequences), no op makes a score matrix, and no K/V head is copied."""
    one, eight = (pools(1).run(cases.layer_traffic, lengths)[0] for lengths in ([512], [64] * 8))
    per_token = [r["backward_bytes"] / r["tokens"] for r in (one, eight)]
    assert per_token[0] > 0
    assert abs(per_token[1] / per_token[0] - 1) <= 0.10, per_token
    assert one["big"] == [], one["big"]  # every width is < 512: only a score matrix would be
    assert one["copies"] == eight["copies"] == 0


MODEL = {"num_layers": 2, "max_seq_len": 64, "num_attention_heads": 4, "num_query_groups": 2}


@pytest.mark.parametrize("lengths", [[64, 64], [40, 17, 64, 3]], ids=["equal", "ragged"])
def test_no_host_read_of_a_tensor_inside_forward_backward(
    pools: Callable[[int], RankPool], lengths: list[int]
) -> None:
    cfg = {"model": MODEL, "max_tokens_per_microbatch": 256}
    [reads] = pools(1).run(cases.host_reads_in_step, cfg, lengths)
    assert reads == [], reads


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"dp": 2}], ids=["tp1", "tp2", "dp2"])
def test_grad_norm_is_a_few_ops_and_the_full_gradients_norm(
    pools: Callable[[int], RankPool], layout: dict[str, int]
) -> None:
    """At most 10 dispatched ops for 2 or 6 layers (a per-tensor norm was ~3 per tensor), and
    equal to the fp64 norm of the whole model's gradient, every canonical tensor once."""
    world = max(layout.values(), default=1)
    counts = {}
    for layers in (2, 6):
        cfg = {"layout": layout, "model": {**MODEL, "num_layers": layers},
               "max_tokens_per_microbatch": 256}  # fmt: skip
        results = pools(world).run(cases.norm_ops, cfg)
        counts[layers] = max(len(r["ops"]) for r in results)
        assert counts[layers] <= 10, results[0]["ops"]
        grads = full_tensors(results, "grads")
        want = float(np.sqrt(sum(np.square(g.astype(np.float64)).sum() for g in grads.values())))
        for r in results:
            assert abs(r["norm"] - want) <= 1e-6 * want, (r["norm"], want)
    assert counts[2] == counts[6], counts


@pytest.mark.parametrize("layout", [{"dp": 2}, {"tp": 2}], ids=["dp2", "tp2"])
def test_fused_adamw_makes_foreachs_update(
    pools: Callable[[int], RankPool], layout: dict[str, int]
) -> None:
    """Five clipped steps with the engine's fused AdamW and with foreach AdamW: the same
    parameters within 1e-6 (fp32). Adam moves a parameter whose gradient is ~0 by up to
    ``lr * d / eps`` for a rounding difference ``d``: eps = 1e-5, as in the layout tests,
    keeps that under the bound (with 1e-8, one element of 65,536 moved 1.3e-6)."""
    cfg = {
        "layout": layout, "model": MODEL, "max_tokens_per_microbatch": 96,
        "optimizer": {"clip_grad": 0.5, "lr": 1e-3, "eps": 1e-5},
    }  # fmt: skip
    fused = pools(2).run(cases.params_after_steps, cfg, 5, False)
    foreach = pools(2).run(cases.params_after_steps, cfg, 5, True)
    assert all(all(r["fused"]) for r in fused) and not any(any(r["fused"]) for r in foreach)
    # Clipping engaged on some step (a norm above 0.5), so the device-side clip is exercised.
    assert max(fused[0]["norms"]) > 0.5, fused[0]["norms"]
    np.testing.assert_allclose(fused[0]["norms"], foreach[0]["norms"], rtol=1e-6)
    got, want = full_tensors(fused, "shard_params"), full_tensors(foreach, "shard_params")
    assert got.keys() == want.keys()
    for name, p in want.items():
        np.testing.assert_allclose(got[name], p, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "layout", [{}, {"tp": 2}, {"cp": 2}, {"dp": 2}], ids=["tp1", "tp2-sp", "cp2", "dp2"]
)
def test_the_heads_gradient_in_the_forward_changes_no_number(
    pools: Callable[[int], RankPool], layout: dict[str, int]
) -> None:
    """A PPO pass with KL: the loss, its RL metrics, the grad norm and every gradient with the
    head's gradient taken in the forward pass equal the two-pass head's (fp32, 1e-5)."""
    world = max(layout.values(), default=1)
    cfg = {"layout": layout, "model": MODEL, "max_tokens_per_microbatch": 96}
    got = pools(world).run(cases.grads_with_the_head_gradient, cfg, True)
    want = pools(world).run(cases.grads_with_the_head_gradient, cfg, False)
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=1e-9)
        assert g["norm"] == pytest.approx(w["norm"], rel=1e-5)
        assert g["metrics"].keys() == w["metrics"].keys() and g["metrics"]
        for k, v in w["metrics"].items():
            assert g["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    grads, ref = full_tensors(got, "grads"), full_tensors(want, "grads")
    assert grads.keys() == ref.keys() and grads
    for name, r in ref.items():
        np.testing.assert_allclose(
            grads[name], r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=name
        )
