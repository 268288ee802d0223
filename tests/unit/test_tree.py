"""Prefix tries (workers/control/trie.py) and tree attention (workers/ops/tree_attention.py):
every sequence is recoverable from its trie rows, and attention over the trie gives each token
exactly what flat causal attention over its own sequence gives it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainctl.workers.control.trie import build_tries, encode_segments
from trainctl.workers.ops.tree_attention import (
    Segments,
    flex_tree_attention,
    subtree_ends,
    tree_attention,
)


def _seqs(*rows: list[int]) -> list[np.ndarray]:
    return [np.asarray(r, np.int64) for r in rows]


def grpo(prompt: int, responses: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 50, prompt)
    return [np.concatenate([p, rng.integers(0, 50, n)]) for n in responses]


def multi_turn(seed: int = 0) -> list[np.ndarray]:
    """Siblings that branch at several depths, a sequence that is a prefix of another, and
    an identical duplicate."""
    rng = np.random.default_rng(seed)
    t1, t2, t3 = (rng.integers(0, 50, n) for n in (7, 5, 4))
    a = np.concatenate([t1, t2, t3])
    b = np.concatenate([t1, t2, rng.integers(0, 50, 6)])
    c = np.concatenate([t1, rng.integers(0, 50, 3)])
    return [a, b, c, np.concatenate([t1, t2]), a.copy(), rng.integers(0, 50, 9)]


CASES = {
    "grpo": grpo(12, [5, 9, 1, 6]),
    "multi_turn": multi_turn(),
    "no_sharing": _seqs([1, 2, 3], [4, 5], [6]),
    "prefix": _seqs([1, 2, 3], [1, 2, 3, 4, 5]),
    "duplicates": _seqs([7, 8, 9], [7, 8, 9]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_sequence_is_its_rows_of_the_trie(name: str) -> None:
    seqs = CASES[name]
    tries = build_tries(seqs, budget=1000)
    seen = sorted(i for t in tries for i in t.members)
    assert seen == list(range(len(seqs)))
    for t in tries:
        for i, rows in zip(t.members, t.rows, strict=True):
            np.testing.assert_array_equal(t.tokens[rows], seqs[i])
            np.testing.assert_array_equal(t.depth[rows], np.arange(len(seqs[i])))
        # Segments tile the trie in order; each one's ancestors are its sequence's prefix.
        assert t.seg_start[0] == 0 and t.seg_end[-1] == t.size
        np.testing.assert_array_equal(t.seg_start[1:], t.seg_end[:-1])
        for a, anc in zip(t.seg_start, t.seg_ancestors, strict=True):
            assert anc.shape[0] == t.depth[a] and (anc < a).all()
    computed = sum(t.size for t in tries)
    unique_prefixes = {tuple(s[: k + 1].tolist()) for s in seqs for k in range(len(s))}
    assert computed == len(unique_prefixes)  # each distinct prefix once, no more


def test_sharing_decides_the_tries() -> None:
    assert len(build_tries(CASES["no_sharing"], budget=1000)) == 3
    assert all(not t.branches for t in build_tries(CASES["no_sharing"], budget=1000))
    prompt = list(range(10, 22))
    group = _seqs(prompt + [1] * 5, prompt + [2] * 9, [*prompt, 3], prompt + [4] * 6)
    (one,) = build_tries(group, budget=1000)
    assert one.size == 12 + 5 + 9 + 1 + 6 and one.branches


def test_a_full_trie_starts_another_under_the_budget() -> None:
    seqs = grpo(12, [8, 8, 8, 8])
    tries = build_tries(seqs, budget=40, pad_multiple=4)
    assert [len(t.members) for t in tries] == [3, 1]
    assert all(-(-t.size // 4) * 4 <= 40 for t in tries)
    with pytest.raises(ValueError, match="exceeds the budget"):
        build_tries(_seqs(list(range(50))), budget=40)


def _dense_reference(q, k, v, ancestor_mask, scale):  # type: ignore[no-untyped-def]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=ancestor_mask, scale=scale
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tree_attention_is_flat_attention_per_sequence(name: str) -> None:
    """q, k and v of a token are functions of (token, depth), as at a first layer: then each
    token's tree-attention output must equal flat causal attention over its own sequence."""
    seqs = CASES[name]
    (trie, *_) = sorted(build_tries(seqs, budget=1000), key=lambda t: -len(t.members))
    gen = torch.Generator().manual_seed(0)
    heads, groups, dim = 4, 2, 8
    tables = [
        torch.randn(50, 64, h, dim, generator=gen, dtype=torch.float64)
        for h in (heads, groups, groups)
    ]

    def qkv(tok: np.ndarray, depth: np.ndarray) -> list[torch.Tensor]:
        t, d = torch.from_numpy(tok), torch.from_numpy(depth)
        return [tab[t, d].requires_grad_() for tab in tables]

    table = torch.from_numpy(encode_segments(trie.seg_start, trie.seg_end, trie.seg_ancestors))
    segs = Segments.decode(table, trie.size)
    q, k, v = qkv(trie.tokens, trie.depth)
    out = tree_attention(q, k, v, segs, scale=0.3)
    for i, rows in zip(trie.members, trie.rows, strict=True):
        fq, fk, fv = qkv(seqs[i], np.arange(len(seqs[i])))
        want = _dense_reference(
            fq, fk, fv, torch.ones(len(rows), len(rows), dtype=torch.bool).tril(), 0.3
        )
        torch.testing.assert_close(out[torch.from_numpy(rows)], want, rtol=1e-12, atol=1e-12)
    # Against one dense [N, N] ancestor mask, values and gradients.
    n = trie.size
    mask = torch.zeros(n, n, dtype=torch.bool)
    for rows in trie.rows:
        r = torch.from_numpy(rows)
        mask[r[:, None], r[None, :]] |= torch.ones(len(r), len(r), dtype=torch.bool).tril()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    want = _dense_reference(q2, k2, v2, mask, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * g).sum().backward()
    (want * g).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert segs.pairs == int(mask.sum())  # the ideal tree cost, exactly


def test_segment_tables_that_do_not_tile_are_refused() -> None:
    good = encode_segments(
        np.array([0, 3]), np.array([3, 5]), [np.zeros(0, np.int64), np.array([0, 1])]
    )
    Segments.decode(torch.from_numpy(good), 5)
    with pytest.raises(ValueError, match="do not tile the 6 packed rows"):
        Segments.decode(torch.from_numpy(good), 6)
    late = encode_segments(
        np.array([0, 3]), np.array([3, 5]), [np.zeros(0, np.int64), np.array([4])]
    )
    with pytest.raises(ValueError, match="does not precede it"):
        Segments.decode(torch.from_numpy(late), 5)


def test_tree_attention_of_a_cp_share_is_its_rows_of_the_whole() -> None:
    """Under CP a rank's queries are its zigzag rows of the trie, against every row's keys
    and values: its outputs are exactly those rows of the whole trie's attention."""
    from trainctl.workers.ops.cp import zigzag_positions

    (trie, *_) = sorted(build_tries(multi_turn(), budget=1000), key=lambda t: -len(t.members))
    n = -(-trie.size // 4) * 4  # padded for cp = 2: a pad segment closes the trie
    starts = np.append(trie.seg_start, trie.size) if n > trie.size else trie.seg_start
    ends = np.append(trie.seg_end, n) if n > trie.size else trie.seg_end
    anc = [*trie.seg_ancestors, np.zeros(0, np.int64)][: len(starts)]
    segs = Segments.decode(torch.from_numpy(encode_segments(starts, ends, anc)), n)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    whole = tree_attention(q, k, v, segs, scale=0.3)
    cu = torch.tensor([0, n])
    for rank in range(2):
        pos = zigzag_positions(cu, 2, rank)
        part = tree_attention(q[pos], k, v, segs, scale=0.3, query_pos=pos)
        torch.testing.assert_close(part, whole[pos], rtol=1e-12, atol=1e-12)


def _packed_tries(*names: str) -> tuple[Segments, torch.Tensor]:
    """Every trie of the named cases packed one after another, as a micro-batch holds them,
    with a pad segment at the end (to a multiple of 4, as cp = 2 pads); and the dense
    ``[N, N]`` ancestor-or-self mask."""
    starts, ends, ancestors, blocks = [], [], [], []
    offset = 0
    for name in names:
        for trie in build_tries(CASES[name], budget=1000):
            starts += [offset + s for s in trie.seg_start.tolist()]
            ends += [offset + e for e in trie.seg_end.tolist()]
            ancestors += [offset + a for a in trie.seg_ancestors]
            blocks.append((offset, trie))
            offset += trie.size
    n = offset + 4 - offset % 4
    starts.append(offset)
    ends.append(n)
    ancestors.append(np.zeros(0, np.int64))
    table = encode_segments(np.array(starts), np.array(ends), ancestors)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[offset:, offset:] = torch.ones(n - offset, n - offset, dtype=torch.bool).tril()  # pads
    for off, trie in blocks:
        for rows in trie.rows:
            r = torch.from_numpy(rows + off)
            mask[r[:, None], r[None, :]] |= torch.ones(len(r), len(r), dtype=torch.bool).tril()
    return Segments.decode(torch.from_numpy(table), n), mask


def test_a_rows_subtree_ends_after_its_last_descendant() -> None:
    """``k <= q < ends[k]`` is the ancestor-or-self relation of the packed tries, pads and
    trie boundaries included (FlexAttention's mask on CUDA is exactly this)."""
    segs, mask = _packed_tries("multi_turn", "grpo", "prefix", "no_sharing")
    ends = subtree_ends(segs)
    n = mask.shape[0]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal((k <= q) & (q < ends[None, :]), mask)


def test_flex_tree_attention_equals_the_dense_ancestor_mask() -> None:
    """The FlexAttention path (its eager reference here; compiled on CUDA in the GPU tier),
    whole and for a CP rank's zigzag queries, against dense attention under the mask."""
    from trainctl.workers.ops.cp import zigzag_positions

    segs, mask = _packed_tries("multi_turn", "duplicates", "grpo")
    n = mask.shape[0]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = flex_tree_attention(q, k, v, segs, scale=0.3, compiled=False)
    torch.testing.assert_close(out, _dense_reference(q, k, v, mask, 0.3), rtol=1e-10, atol=1e-12)
    per_segment = tree_attention(q, k, v, segs, scale=0.3)
    torch.testing.assert_close(out, per_segment, rtol=1e-10, atol=1e-12)
    for rank in range(2):
        pos = zigzag_positions(torch.tensor([0, n]), 2, rank)
        part = flex_tree_attention(
            q[pos], k, v, segs, scale=0.3, query_pos=pos, query_key=rank, compiled=False
        )
        torch.testing.assert_close(part, out[pos], rtol=1e-10, atol=1e-12)
