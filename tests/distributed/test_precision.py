"""bf16 mixed precision and ZeRO-1 (megatron's distributed optimizer) on the CPU.

* bf16 tracks fp32 over ten steps, with bf16 parameters, fp32 main gradients and fp32 master
  weights;
* in bf16, dp2 and cp2 (ZeRO on, as by default) equal dp1;
* ZeRO keeps 1/(dp x cp) of the optimizer state per rank, and its grad norm (from the shards)
  and steps equal dp1 in fp32;
* a ZeRO checkpoint restores exactly: the same next steps, the same weights, fp32 and bf16.

The layout matrix (test_engine_layouts.py) runs every dp/cp layout with ZeRO on as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from helpers.rankpool import RankPool
from state_cases import checkpoint_restore_case, train_steps_case

MODEL = {"num_layers": 4, "max_seq_len": 64, "num_attention_heads": 4, "num_query_groups": 2}
BF16_EPS = 2.0**-8
"""bf16's machine epsilon (8 significant bits). The tolerance of bf16 against fp32, and of one
bf16 layout against another, is this, relative, on each step's loss and grad norm: every
activation carries a rounding error of up to eps/2, but the loss is a mean over hundreds of
tokens, so its error stays a fraction of eps (measured: 5e-4 of the loss against fp32 over ten
steps, 8x inside the bound). A dropped fp32 master weight or a bf16 log-prob is well outside
it."""
FP32_RTOL = 1e-5


def _cfg(precision: str, optimizer: str = "auto", **layout: int) -> dict[str, Any]:
    return {
        "layout": layout,
        "precision": precision,
        "distributed_optimizer": optimizer,
        "max_tokens_per_microbatch": 96,
        "model": MODEL,
        "optimizer": {"clip_grad": 1.0, "eps": 1e-5},
    }


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _last(results: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in results if r["is_last_stage"])


def test_bf16_tracks_fp32_over_ten_steps(pool1: RankPool) -> None:
    (fp32,) = pool1.run(train_steps_case, _cfg("fp32"), 10)
    (bf16,) = pool1.run(train_steps_case, _cfg("bf16"), 10)
    assert fp32["param_dtypes"] == fp32["master_dtypes"] == ["torch.float32"]
    assert bf16["param_dtypes"] == ["torch.bfloat16"]
    assert bf16["main_grad_dtypes"] == bf16["master_dtypes"] == ["torch.float32"]
    assert bf16["losses"] != fp32["losses"]  # it really ran in another precision
    assert _rel(bf16["losses"], fp32["losses"]) <= BF16_EPS, (bf16["losses"], fp32["losses"])
    assert _rel(bf16["grad_norms"], fp32["grad_norms"]) <= 4 * BF16_EPS
    assert fp32["losses"][-1] < fp32["losses"][0]  # ten steps of learning, not ten no-ops


@pytest.mark.parametrize("layout", [{"dp": 2}, {"cp": 2}], ids=["dp2", "cp2"])
def test_bf16_layouts_equal_dp1(pools: Callable[[int], RankPool], layout: dict[str, int]) -> None:
    (ref,) = pools(1).run(train_steps_case, _cfg("bf16"), 3)
    results = pools(2).run(train_steps_case, _cfg("bf16", **layout), 3)
    got = _last(results)
    assert got["param_dtypes"] == ["torch.bfloat16"]
    assert _rel(got["losses"], ref["losses"]) <= BF16_EPS, (got["losses"], ref["losses"])
    for r in results:
        assert _rel(r["grad_norms"], ref["grad_norms"]) <= BF16_EPS


@pytest.mark.parametrize("layout", [{"dp": 2}, {"cp": 2}], ids=["dp2", "cp2"])
def test_zero_shards_the_optimizer_and_equals_dp1(
    pools: Callable[[int], RankPool], layout: dict[str, int]
) -> None:
    (ref,) = pools(1).run(train_steps_case, _cfg("fp32"), 3)
    sharded = pools(2).run(train_steps_case, _cfg("fp32", "on", **layout), 3)
    whole = pools(2).run(train_steps_case, _cfg("fp32", "off", **layout), 3)
    n = ref["num_parameters"]
    # Without ZeRO each rank keeps Adam's two moments of every parameter; with it, about half
    # (megatron pads each bucket to a multiple of the group size).
    assert all(r["adam_state_numel"] == 2 * n for r in whole)
    assert all(r["adam_state_numel"] <= 2 * (n // 2 + 64) for r in sharded)
    assert sum(r["master_numel"] for r in sharded) == n
    for results in (sharded, whole):
        for r in results:  # the norm from the shards equals the single-rank norm
            assert _rel(r["grad_norms"], ref["grad_norms"]) <= FP32_RTOL, r["grad_norms"]
        assert _rel(_last(results)["losses"], ref["losses"]) <= FP32_RTOL


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_checkpoint_restores_exactly(pool2: RankPool, precision: str) -> None:
    for r in pool2.run(checkpoint_restore_case, _cfg(precision, "on", dp=2)):
        saved, first, loaded, again = r["digests"]
        assert first != saved and loaded == saved and again == first
        assert r["again"] == r["first"]
