"""The reshardable format's pieces (workers/engine/checkpoint/reshard.py), without ranks: a tensor
written in ranges by several TP and ZeRO ranks is cut again for another TP, whatever its
shard rule, from the pieces that shard overlaps alone; a gap is an error naming the tensor."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from trainctl.workers.engine import weights
from trainctl.workers.engine.checkpoint import reshard
from trainctl.workers.engine.checkpoint.reshard import Pieces

NAMES = {
    "dim 0": "decoder.layers.0.self_attention.linear_qkv.weight",
    "dim 1": "decoder.layers.0.self_attention.linear_proj.weight",
    "glu": "decoder.layers.0.mlp.linear_fc1.weight",
    "replicated": "decoder.layers.0.input_layernorm.weight",
    "dim 0, 3-D": "decoder.layers.0.self_attention.conv1d.weight",
}
SHAPES = {"replicated": (8,), "dim 0, 3-D": (16, 1, 4)}


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


@pytest.mark.parametrize("chunk", [reshard._CHUNK, 4, 24], ids=["chunk", "by-row", "3-rows"])
@pytest.mark.parametrize("kind", sorted(NAMES))
@pytest.mark.parametrize(("tp", "new_tp"), [(2, 2), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_tensor_written_in_ranges_is_cut_again_for_another_tp(
    kind: str, tp: int, new_tp: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chunk``: the elements read at once across a writer shard's rows (fewer than a row:
    each row's range alone)."""
    monkeypatch.setattr(reshard, "_CHUNK", chunk)
    name = NAMES[kind]
    full = torch.randn(*SHAPES.get(kind, (16, 8)))
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
        # A ZeRO rank's range of the moments alone, also a tensor of its own.
        ours = saved.shard(name, r, new_tp, "exp_avg", slice(3, 7))
        assert torch.equal(ours, 2 * rule.shard(full, r, new_tp).reshape(-1)[3:7])
        assert ours.untyped_storage().nbytes() == 4 * 4


def test_a_range_no_file_holds_is_an_error_naming_the_tensor() -> None:
    name = NAMES["dim 0"]
    files = _written(name, torch.randn(16, 8), tp=2, zero=2)
    del files[1]  # TP rank 0's second range
    with pytest.raises(ValueError, match=r"linear_qkv.weight \(TP shard 0\) lacks elements 32"):
        Pieces(files).full(name)
    files = _written(name, torch.randn(16, 8), tp=2, zero=1)[:1]  # TP rank 1 wrote nothing
    with pytest.raises(ValueError, match=r"linear_qkv.weight lacks TP shard 1"):
        Pieces(files).full(name)


@pytest.mark.parametrize("kind", ["dim 0", "dim 1", "glu"])
def test_a_shard_is_cut_from_the_pieces_it_overlaps_alone(kind: str) -> None:
    """A rank of the new layout reads no piece outside its shard: with every other piece gone
    its shard is still exact (a TP 1 -> 2 row cut), and so is a TP 4 -> 2 shard with the two
    writer shards it does not overlap gone. No rank puts the whole tensor together."""
    name, full = NAMES[kind], torch.randn(16, 8)
    rule = weights.shard_rule(name)
    want = [rule.shard(full, r, 2) for r in range(2)]
    files = _written(name, full, tp=4, zero=2)
    for r in range(2):
        mine = [f for f in files if f[name]["tp"] // 2 == r]  # writers 2r and 2r + 1
        assert torch.equal(Pieces(mine).shard(name, r, 2), want[r])
    if kind == "dim 1":  # a column cut needs every row: nothing to leave out at TP 1
        return
    files = _written(name, full, tp=1, zero=8)  # eight flat ranges of the one shard
    flat_index = torch.arange(full.numel()).view(full.shape)
    for r in range(2):
        used = rule.shard(flat_index, r, 2).reshape(-1)  # the elements rank r's shard holds
        mine = [f for f in files if ((used >= f[name]["lo"]) & (used < f[name]["hi"])).any()]
        assert len(mine) < len(files)
        assert torch.equal(Pieces(mine).shard(name, r, 2), want[r])
