"""Zigzag CP split (docs/algorithms.md §1.2-§1.4; acceptance tests T1.1-T1.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainctl.api import TokenSequence
from trainctl.workers.control.plan import pack
from trainctl.workers.engine.inputs import packed_tokens
from trainctl.workers.ops.cp import (
    reassemble,
    split_for_cp,
    zigzag_inverse,
    zigzag_positions,
)


def _seq(tokens: list[int], mask: list[int]) -> TokenSequence:
    return TokenSequence(
        tokens=np.asarray(tokens, np.int64), loss_mask=np.asarray(mask, np.float32)
    )


def _example():
    # docs/algorithms.md §1.3: c = 2, lengths 5 and 7, A's prompt a0 a1, B's prompt b0 b1 b2.
    a = _seq([10, 11, 12, 13, 14], [0, 0, 1, 1, 1])
    b = _seq([20, 21, 22, 23, 24, 25, 26], [0, 0, 0, 1, 1, 1, 1])
    return packed_tokens(pack([a, b], [0, 1], pad_multiple=4))


def test_t1_1_zigzag_layout_5_7() -> None:
    batch = _example()
    assert batch.cu_seqlens.tolist() == [0, 8, 16]
    r0, r1 = (split_for_cp(batch.per_token, batch.cu_seqlens, cp_size=2, cp_rank=r) for r in (0, 1))
    assert r0.positions.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert r1.positions.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert r0.per_token["input_ids"].tolist() == [10, 11, 0, 0, 20, 21, 26, 0]
    assert r1.per_token["input_ids"].tolist() == [12, 13, 14, 0, 22, 23, 24, 25]
    assert r0.local_cu_seqlens.tolist() == [0, 4, 8] == r1.local_cu_seqlens.tolist()
    assert r0.global_cu_seqlens.tolist() == [0, 8, 16]
    # 7 valid tokens: 1 on rank 0 (global position 1), 6 on rank 1 (2, 3, 10..13).
    valid0 = r0.positions[r0.per_token["loss_mask"] > 0].tolist()
    valid1 = r1.positions[r1.per_token["loss_mask"] > 0].tolist()
    assert valid0 == [1] and valid1 == [2, 3, 10, 11, 12, 13]


@pytest.mark.parametrize("c", [2, 4, 8])
def test_t1_2_split_reassemble_roundtrip(c: int) -> None:
    lengths = [2 * c * k for k in (4, 6, 3)] + [2 * c * 2]  # the last: a trailing pad sequence
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    total = int(cu[-1])
    inverse = zigzag_inverse(cu, c)
    assert sorted(inverse.tolist()) == list(range(total))  # a bijection
    x = torch.randn(total, 3, dtype=torch.float64)
    locals_ = [x[zigzag_positions(cu, c, r)] for r in range(c)]
    assert all(t.shape[0] == total // c for t in locals_)
    assert torch.equal(reassemble(locals_, cu), x)


def test_split_rejects_unpadded_sequences() -> None:
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp_size = 4"):
        zigzag_positions(torch.tensor([0, 6], dtype=torch.int32), 2, 0)


def _next_token_ok(shard, batch) -> bool:
    t = shard.per_token
    pos = shard.positions
    for i in torch.nonzero(t["loss_mask"]).flatten().tolist():
        if t["labels"][i] != batch.input_ids[pos[i] + 1]:
            return False
    return True


@pytest.mark.parametrize("c", [2, 4])
def test_t1_3_labels_rolled_before_split(c: int) -> None:
    rng = np.random.default_rng(0)
    seqs = [_seq(rng.integers(1, 99, n).tolist(), [0] + [1] * (n - 1)) for n in (13, 30, 7)]
    batch = packed_tokens(pack(seqs, [0, 1, 2], pad_multiple=2 * c))
    for r in range(c):
        assert _next_token_ok(
            split_for_cp(batch.per_token, batch.cu_seqlens, cp_size=c, cp_rank=r), batch
        )
    # The wrong order - split, then roll locally - mislabels the chunk edges.
    r0 = split_for_cp(batch.per_token, batch.cu_seqlens, cp_size=c, cp_rank=0)
    wrong = torch.roll(r0.per_token["input_ids"], -1)
    bad = [
        i
        for i in torch.nonzero(r0.per_token["loss_mask"]).flatten().tolist()
        if wrong[i] != batch.input_ids[r0.positions[i] + 1]
    ]
    assert bad, "split-then-roll should mislabel chunk edges"


@pytest.mark.parametrize("c", [1, 2, 4])
def test_t1_4_mask_boundaries(c: int) -> None:
    seqs = [_seq(list(range(1, n + 1)), [1] * n) for n in (5, 9, 12)]  # all-ones masks
    batch = packed_tokens(pack(seqs, [0, 1, 2], pad_multiple=2 * c))
    cu = batch.cu_seqlens.tolist()
    for i, n in enumerate((5, 9, 12)):
        last, pads = cu[i] + n - 1, range(cu[i] + n, cu[i + 1])
        assert batch.loss_mask[last] == 0 and all(batch.loss_mask[p] == 0 for p in pads)
    total_valid = sum(
        int(
            split_for_cp(batch.per_token, batch.cu_seqlens, cp_size=c, cp_rank=r)
            .per_token["loss_mask"]
            .sum()
        )
        for r in range(c)
    )
    assert total_valid == int(batch.loss_mask.sum()) == 4 + 8 + 11
