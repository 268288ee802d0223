"""Packed causal attention against one dense block-diagonal causal mask over the whole buffer
(the definition), for runs of equal lengths, ragged packs and empty sequences; grouped heads
without a copy where SDPA takes them."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from trainctl.workers.ops.packed_attention import (
    cp_packed_attention,
    equal_runs,
    packed_attention,
)

NP, NG, HN = 4, 2, 16


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    t = q.shape[0]
    seq = torch.zeros(t, dtype=torch.long)
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        seq[a:b] = i
    pos = torch.arange(t)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    rep = NP // NG
    qq, kk, vv = (
        x.transpose(0, 1)[None]
        for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    )
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)[0].transpose(0, 1)


PACKS = {
    "one": [48],
    "equal": [16, 16, 16],
    "runs": [8, 8, 8, 20, 20, 3],
    "ragged-with-empty": [5, 0, 17, 1, 9, 0],
}


@pytest.mark.parametrize("lengths", PACKS.values(), ids=PACKS.keys())
def test_equals_the_dense_block_diagonal_mask(lengths: list[int]) -> None:
    cu = [0, *itertools.accumulate(lengths)]
    t = cu[-1]
    g = torch.Generator().manual_seed(len(lengths))
    q = torch.randn(t, NP, HN, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, NG, HN, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, NG, HN, generator=g, dtype=torch.float64, requires_grad=True)
    got = packed_attention(q, k, v, cu, scale=HN**-0.5)
    want = _dense(q, k, v, cu)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    out_grad = torch.randn_like(got)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), out_grad),
        torch.autograd.grad(want, (q, k, v), out_grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_runs_group_consecutive_equal_lengths_and_drop_empty_ones() -> None:
    assert equal_runs([8, 8, 0, 8, 20, 20, 3]) == [(8, 3), (20, 2), (3, 1)]
    assert equal_runs([]) == []


def test_boundaries_must_cover_the_rows() -> None:
    q = torch.randn(10, NP, HN)
    k = v = torch.randn(10, NG, HN)
    with pytest.raises(ValueError, match="do not cover"):
        packed_attention(q, k, v, [0, 4, 9], scale=1.0)


def test_context_parallel_queries_see_their_global_causal_past() -> None:
    """Two CP ranks' zigzag chunks attend over the gathered keys: together, the dense answer."""
    lengths, c = [8, 12], 2
    cu = [0, *itertools.accumulate(lengths)]
    q = torch.randn(cu[-1], NP, HN, dtype=torch.float64)
    k = torch.randn(cu[-1], NG, HN, dtype=torch.float64)
    v = torch.randn(cu[-1], NG, HN, dtype=torch.float64)
    want = _dense(q, k, v, cu)
    for r in range(c):
        rows = []
        for a, n in zip(cu, lengths, strict=False):
            h = n // (2 * c)
            late = 2 * c - 1 - r
            rows += [*range(a + r * h, a + (r + 1) * h), *range(a + late * h, a + (late + 1) * h)]
        got = cp_packed_attention(q[rows], k, v, cu, cp_size=c, cp_rank=r, scale=HN**-0.5)
        torch.testing.assert_close(got, want[rows], rtol=1e-10, atol=1e-10)
