"""The reshardable checkpoint (workers/engine/checkpoint/reshard.py): a run trained 3 steps
at layout A, saved, loaded at layout B and trained 2 more equals the same 5 steps at A -
losses, grad norms, an eval loss and every parameter, within 1e-5 - for dense models, MoE
experts, Gated DeltaNet and LoRA adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reshard_cases import resharded_run

from helpers.layouts import FAMILY_SHAPES, MOE, engine_cfg, full_tensors, layout_id, world_size
from helpers.rankpool import RankPool

TOL = 1e-5
FIRST, THEN = [0, 1, 2], [3, 4]
ADAPTER = {"name": "a", "rank": 4, "alpha": 8.0, "targets": ["attention", "mlp"], "seed": 3}

PAIRS: list[tuple[dict[str, int], dict[str, int], str]] = [
    ({"dp": 2}, {}, "dense"),
    ({}, {"tp": 2}, "dense"),
    ({"tp": 2}, {"pp": 2}, "dense"),
    ({"dp": 2, "cp": 2}, {"tp": 2, "pp": 2}, "dense"),
    ({"dp": 2, "ep": 2}, {}, "moe"),
    ({"tp": 2}, {}, "qwen3_5"),
    ({"dp": 2}, {"tp": 2}, "lora"),
]


def _cfg(model: str, layout: dict[str, int]) -> dict[str, Any]:
    cfg = engine_cfg(**layout)
    if model == "moe":
        cfg["model"] = MOE
    elif model == "qwen3_5":
        cfg["model"] = FAMILY_SHAPES["qwen3_5"]
    elif model == "lora":
        cfg["lora"] = {"max_adapters": 2, "max_rank": 8}
    return cfg


def _last(results: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in results if r["is_last_stage"])


def _gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The largest difference between two runs' parameters (full canonical tensors)."""
    pa, pb = full_tensors(a, "shard_params"), full_tensors(b, "shard_params")
    assert pa.keys() == pb.keys() and pa
    return max(float(np.abs(pa[n] - pb[n]).max()) for n in pa)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and np.allclose(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("a", "b", "model"), PAIRS, ids=[f"{m}-{layout_id(a)}-to-{layout_id(b)}" for a, b, m in PAIRS]
)
def test_a_checkpoint_resumes_on_another_layout(
    pools: Callable[[int], RankPool],
    tmp_path: Path,
    a: dict[str, int],
    b: dict[str, int],
    model: str,
) -> None:
    adapter = ADAPTER if model == "lora" else None
    pool_a, pool_b = pools(world_size(a)), pools(world_size(b))
    d = str(tmp_path)
    whole = pool_a.run(resharded_run, _cfg(model, a), d, FIRST + THEN, {"adapter": adapter})
    pool_a.run(resharded_run, _cfg(model, a), d, FIRST, {"save": True, "adapter": adapter})
    resumed = pool_b.run(resharded_run, _cfg(model, b), d, THEN, {"load": True, "adapter": adapter})
    want, got = _last(whole), _last(resumed)
    assert got["step"] == want["step"] == len(FIRST + THEN)
    assert _close(got["losses"], want["losses"][len(FIRST) :]), (got["losses"], want["losses"])
    assert _close(got["grad_norms"], want["grad_norms"][len(FIRST) :])
    assert _close([got["eval_loss"]], [want["eval_loss"]])
    gap = _gap(resumed, whole)
    assert gap <= TOL, gap
    # The comparison sees a dropped optimizer state: resumed without it, the parameters move
    # off the uninterrupted run's by far more than the tolerance.
    fresh = pool_b.run(
        resharded_run, _cfg(model, b), d, THEN,
        {"load": True, "optimizer": False, "adapter": adapter},
    )  # fmt: skip
    print("GAPS", gap, _gap(fresh, whole))
    assert _gap(fresh, whole) > 100 * TOL


def test_an_adapter_saved_alone_resumes_on_another_layout_under_another_name(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """A LoRA adapter's checkpoint alone (what a Tinker client's ``save_state`` writes), saved
    at dp2 and loaded at tp2 as another adapter: its next two steps equal the dp2 run's."""
    a, b = {"dp": 2}, {"tp": 2}
    d = str(tmp_path)
    only = {"adapter": ADAPTER, "only": ADAPTER["name"]}
    whole = pools(2).run(resharded_run, _cfg("lora", a), d, FIRST + THEN, {"adapter": ADAPTER})
    pools(2).run(resharded_run, _cfg("lora", a), d, FIRST, {**only, "save": True})
    resumed = pools(2).run(
        resharded_run, _cfg("lora", b), d, THEN, {**only, "load": True, "into": "b"}
    )
    want, got = _last(whole), _last(resumed)
    assert _close(got["losses"], want["losses"][len(FIRST) :]), (got["losses"], want["losses"])
    assert _gap(resumed, whole) <= TOL


def test_an_fp32_checkpoint_resumes_in_bf16(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """A precision change is allowed: the file holds fp32 values, which become bf16's fp32
    master weights. The next steps track the fp32 run within bf16's rounding (eps = 2^-8)."""
    d = str(tmp_path)
    fp32, bf16 = _cfg("dense", {"dp": 2}), {**_cfg("dense", {}), "precision": "bf16"}
    whole = pools(2).run(resharded_run, {**fp32, "precision": "fp32"}, d, FIRST + THEN, {})
    pools(2).run(resharded_run, {**fp32, "precision": "fp32"}, d, FIRST, {"save": True})
    resumed = pools(1).run(resharded_run, bf16, d, THEN, {"load": True})
    want, got = _last(whole), _last(resumed)
    assert got["step"] == 5
    eps = 2.0**-8
    assert np.allclose(got["losses"], want["losses"][len(FIRST) :], rtol=eps, atol=0)
    # The moments came along: the parameters stay nearer the fp32 run's than a resume with
    # a fresh AdamW (measured mean gaps 5.0e-4 and 1.3e-3).
    fresh = pools(1).run(resharded_run, bf16, d, THEN, {"load": True, "optimizer": False})
    assert _mean_gap(resumed, whole) < 0.6 * _mean_gap(fresh, whole)


def _mean_gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    pa, pb = full_tensors(a, "shard_params"), full_tensors(b, "shard_params")
    return float(np.mean([np.abs(pa[n] - pb[n]).mean() for n in pa]))


@pytest.mark.parametrize("b", [{"dp": 2}, {"tp": 2}], ids=layout_id)
def test_a_bf16_run_with_zero_resumes_from_its_master_weights(
    pools: Callable[[int], RankPool], tmp_path: Path, b: dict[str, int]
) -> None:
    """bf16 at dp2 with ZeRO-1: each rank writes its range of the fp32 masters and moments.
    Resumed at dp2 the next steps are the uninterrupted run's exactly; at tp2 they track it
    within bf16's rounding (another layout rounds its bf16 sums differently)."""
    d = str(tmp_path)
    cfg = {**_cfg("dense", {"dp": 2}), "precision": "bf16"}
    whole = pools(2).run(resharded_run, cfg, d, FIRST + THEN, {})
    pools(2).run(resharded_run, cfg, d, FIRST, {"save": True})
    resumed = pools(2).run(
        resharded_run, {**_cfg("dense", b), "precision": "bf16"}, d, THEN, {"load": True}
    )
    want, got = _last(whole)["losses"][len(FIRST) :], _last(resumed)["losses"]
    if b == {"dp": 2}:
        assert got == want and _gap(resumed, whole) == 0.0
    else:
        assert np.allclose(got, want, rtol=2.0**-8, atol=0), (got, want)
