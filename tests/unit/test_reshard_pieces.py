"""The reshardable format's pieces (workers/engine/reshard.py), without ranks: a tensor
written in ranges by several TP and ZeRO ranks is put back together and cut again for
another TP, whatever its shard rule; a gap is an error naming the tensor."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from trainctl.workers.engine import weights
from trainctl.workers.engine.reshard import Pieces

NAMES = {
    "dim 0": "decoder.layers.0.self_attention.linear_qkv.weight",
    "dim 1": "decoder.layers.0.self_attention.linear_proj.weight",
    "glu": "decoder.layers.0.mlp.linear_fc1.weight",
    "replicated": "decoder.layers.0.input_layernorm.weight",
}


def _written(name: str, full: torch.Tensor, tp: int, zero: int) -> list[dict[str, Any]]:
    """The rank files' parts as ``tp`` TP ranks, each with ``zero`` ZeRO ranges, write
    ``full``: one dict of pieces per rank."""
    rule = weights.shard_rule(name)
    files = []
    for r in range(tp):
        shard = rule.shard(full, r, tp)
        flat = shard.reshape(-1)
        bounds = torch.linspace(0, flat.numel(), zero + 1).long().tolist()
        for lo, hi in itertools.pairwise(bounds):
            piece = {"tp": r, "tp_size": tp, "shape": list(shard.shape), "lo": lo, "hi": hi,
                     "param": flat[lo:hi].clone(), "exp_avg": 2 * flat[lo:hi]}  # fmt: skip
            files.append({name: piece})
    return files


@pytest.mark.parametrize("kind", sorted(NAMES))
@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_tensor_written_in_ranges_is_cut_again_for_another_tp(
    kind: str, tp: int, new_tp: int
) -> None:
    name = NAMES[kind]
    full = torch.randn(8) if kind == "replicated" else torch.randn(16, 8)
    saved = Pieces(_written(name, full, tp, zero=3))
    assert saved.full_shape(name) == tuple(full.shape)
    assert torch.equal(saved.full(name), full)
    assert torch.equal(saved.full(name, "exp_avg"), 2 * full)
    rule = weights.shard_rule(name)
    for r in range(new_tp):
        got = saved.shard(name, r, new_tp)
        assert torch.equal(got, rule.shard(full, r, new_tp))
        # A tensor of its own: a staged shard must not keep the whole tensor alive.
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_a_range_no_file_holds_is_an_error_naming_the_tensor() -> None:
    name = NAMES["dim 0"]
    files = _written(name, torch.randn(16, 8), tp=2, zero=2)
    del files[1]  # TP rank 0's second range
    with pytest.raises(ValueError, match=r"linear_qkv.weight \(TP shard 0\) lacks elements 32"):
        Pieces(files).full(name)
    files = _written(name, torch.randn(16, 8), tp=2, zero=1)[:1]  # TP rank 1 wrote nothing
    with pytest.raises(ValueError, match=r"lacks TP shards \[1\]"):
        Pieces(files).full(name)
