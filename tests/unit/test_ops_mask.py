"""Blockwise causal mask (docs/algorithms.md §2.3; T2.5, T2.6)."""

from __future__ import annotations

import pytest
import torch

from trainctl.workers.ops import mask as mask_mod
from trainctl.workers.ops.mask import blockwise_causal_mask


def naive(seq_positions: list[torch.Tensor], n: int) -> torch.Tensor:
    m = torch.zeros(n, n, dtype=torch.bool)
    for pos in seq_positions:
        tri = torch.tril(torch.ones(len(pos), len(pos), dtype=torch.bool))
        m[pos[:, None], pos[None, :]] = tri
    return m


def _layout(lengths: list[int], seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """Non-contiguous positions: sequences interleaved in random order (like trie segments)."""
    n = sum(lengths)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out, start = [], 0
    for length in lengths:
        out.append(perm[start : start + length].sort().values)
        start += length
    return out, n


def test_t2_5_blockwise_equals_naive_small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mask_mod, "BLOCK", 4)
    positions, n = _layout([1, 3, 4, 5, 11, 12])
    got = blockwise_causal_mask(positions, n)
    assert torch.equal(got, naive(positions, n))
    owner = torch.empty(n, dtype=torch.long)
    for i, pos in enumerate(positions):
        owner[pos] = i
    rows, cols = torch.nonzero(got, as_tuple=True)
    assert torch.equal(owner[rows], owner[cols])  # no attention across sequences


def test_t2_5_blockwise_equals_naive_2048() -> None:
    positions, n = _layout([4100, 7])
    assert torch.equal(blockwise_causal_mask(positions, n), naive(positions, n))


def test_t2_6_bounded_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mask_mod, "BLOCK", 4)
    real = torch.tril_indices

    def checked(row: int, col: int, *a, **k):
        assert row <= 4 and col <= 4, (row, col)
        return real(row, col, *a, **k)

    monkeypatch.setattr(torch, "tril_indices", checked)
    positions, n = _layout([11, 12, 3])
    blockwise_causal_mask(positions, n)
