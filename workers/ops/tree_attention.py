"""Tree attention over packed prefix tries, at the cost of the tree (docs/algorithms.md §10).

A trie is laid out depth-first as *segments*: chains of tokens, each with a list of ancestor
rows (the tokens before it on its path from the root). A token attends to its segment's
ancestors and, causally, to its own segment up to itself: exactly its ancestors and itself.
Each segment is one ``scaled_dot_product_attention`` call whose keys are its ancestors' rows
gathered, then its own rows, so the work is the sum over tokens of their number of ancestors
(the ideal tree cost), never ``N x N`` over the packed trie, and no ``[N, N]`` mask exists.
A segment without ancestors is plain causal attention (the flat path).

The segment table travels as one int64 tensor (built by the controller's planner):
``[k, start(k), end(k), offsets(k + 1), ancestor rows...]``; segment ``i`` covers rows
``[start[i], end[i])`` and its ancestors are ``rows[offsets[i]:offsets[i + 1]]``. The segments
tile the packed rows in order (pads are segments of their own).

Context parallelism: the trie is zigzag-split like a sequence; keys and values are gathered
over the CP group (all ``N`` rows, global order) and this rank's queries are the rows at
``query_pos`` (their global indices). Each segment then attends with the local queries that
fall in it, masked by ancestry over global positions: every ancestor, and its own rows up to
the query's.

On CUDA the same attention runs as one FlexAttention call (``flex_tree_attention``) whose block
mask skips every 128 x 128 tile holding no (token, ancestor) pair, so its cost follows the tree
at tile granularity. In depth-first order a row's descendants are the rows right after it, up
to the end of its subtree (``subtree_ends``): key ``k`` is an ancestor of (or is) query ``q``
exactly when ``k <= q < end[k]``, a mask of two comparisons per pair that needs no ``[N, N]``
table.

Shapes: query ``[t, np, hn]`` (``t = N`` without CP), key/value ``[N, ng, hn]`` (``np`` a
multiple of ``ng``: grouped-query attention) -> ``[t, np, hn]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.ops.packed_attention import sdpa


@dataclass(frozen=True)
class Segments:
    start: list[int]
    end: list[int]
    ancestors: list[Tensor]  # per segment, int64 rows
    _masks: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """FlexAttention block masks by (device, queries): built once, used by every layer."""

    @classmethod
    def decode(cls, table: Tensor, num_rows: int) -> Segments:
        """Read the table and check that its segments tile ``[0, num_rows)``."""
        t = table.tolist()
        k = int(t[0])
        start, end = t[1 : 1 + k], t[1 + k : 1 + 2 * k]
        offsets = t[1 + 2 * k : 2 + 3 * k]
        rows = table[2 + 3 * k :]
        if k == 0 or start[0] != 0 or end[-1] != num_rows or start[1:] != end[:-1]:
            raise ValueError(f"tree segments do not tile the {num_rows} packed rows")
        if any(e <= s for s, e in zip(start, end, strict=True)):
            raise ValueError("tree segments must not be empty")
        anc = [rows[offsets[i] : offsets[i + 1]] for i in range(k)]
        for i, a in enumerate(anc):
            if a.numel() and int(a.max()) >= start[i]:
                raise ValueError(f"tree segment {i} has an ancestor that does not precede it")
        return cls(start=start, end=end, ancestors=anc)

    @property
    def pairs(self) -> int:
        """(query, key) pairs attended: the sum over tokens of their ancestors and itself."""
        total = 0
        for s, e, a in zip(self.start, self.end, self.ancestors, strict=True):
            n = e - s
            total += n * int(a.numel()) + n * (n + 1) // 2
        return total


def subtree_ends(segments: Segments) -> Tensor:
    """``[N]``: one past the last row of each row's subtree. A row's subtree is the rest of
    its segment and every segment that has it among its ancestors (in depth-first order, the
    last such segment ends the subtree)."""
    spans = zip(segments.start, segments.end, strict=True)
    ends = torch.cat([torch.full((e - s,), e, dtype=torch.long) for s, e in spans])
    for e, anc in zip(segments.end, segments.ancestors, strict=True):
        if anc.numel():
            ends.scatter_reduce_(0, anc, torch.full_like(anc, e), reduce="amax")
    return ends


def _flex_mask(segments: Segments, query_pos: Tensor | None, n_q: int, device: Any) -> Any:
    """The block mask of ``k <= q < end[k]`` (queries at ``query_pos``, global rows)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ends = subtree_ends(segments).to(device)
    n_kv = int(ends.numel())
    qpos = torch.arange(n_q, device=device) if query_pos is None else query_pos.to(device)

    def ancestor_or_self(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q = qpos[q_idx]
        return (kv_idx <= q) & (q < ends[kv_idx])

    return create_block_mask(
        ancestor_or_self, B=None, H=None, Q_LEN=n_q, KV_LEN=n_kv, device=device
    )


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """FlexAttention compiled once per process (its eager form is a slow reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Segments,
    *,
    scale: float,
    query_pos: Tensor | None = None,
    query_key: int | None = None,
    compiled: bool = True,
) -> Tensor:
    """``tree_attention`` as one FlexAttention call (the same arguments, no dropout). The
    block mask is built once per micro-batch, device and query set, and kept on ``segments``
    for the next layer: ``query_key`` names the query set ``query_pos`` is (the CP rank); with
    ``query_pos`` and no key, the mask is built for this call alone. ``compiled=False`` runs
    FlexAttention's eager reference (it materialises ``[t, N]`` scores: for checking the mask
    on small inputs, on any device)."""
    from torch.nn.attention.flex_attention import flex_attention

    n_q = query.shape[0]
    cache_key = (str(query.device), n_q, query_key)
    cacheable = query_pos is None or query_key is not None
    mask = segments._masks.get(cache_key) if cacheable else None
    if mask is None:
        mask = _flex_mask(segments, query_pos, n_q, query.device)
        if cacheable:
            segments._masks[cache_key] = mask
    fn: Callable[..., Any] = flex_attention
    options: dict[str, Any] | None = None
    if compiled:
        fn = _compiled_flex()
        # Always the training kernel: for fewer than 128 queries torch would pick its decoding
        # kernel, which has no configuration for fp32 with grouped query heads (torch 2.11 on
        # an H200 raised NoValidChoicesError for 121 queries, head_dim 128).
        options = {"BACKEND": "TRITON"}
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = fn(
        q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=options,
    )  # fmt: skip
    attended: Tensor = out[0]
    return attended.transpose(0, 1)


def tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Segments,
    *,
    scale: float,
    dropout_p: float = 0.0,
    query_pos: Tensor | None = None,
) -> Tensor:
    """Each token attends to its ancestors and itself (see the module docstring); the queries
    are the rows at ``query_pos`` of the trie (all of it, in order, when None).

    Every tensor is cut once: the segments' own rows by one ``split``, every segment's ancestor
    rows by one ``index_select`` then a ``split``, and (under CP) the local queries by one
    permutation into segment order. Per-segment slicing would give each slice a backward that
    writes a full-size zero gradient."""
    lengths = [e - s for s, e in zip(segments.start, segments.end, strict=True)]
    counts = [int(a.numel()) for a in segments.ancestors]
    own_k, own_v = key.split(lengths), value.split(lengths)
    anc_k: tuple[Tensor, ...] = ()
    anc_v: tuple[Tensor, ...] = ()
    if sum(counts):
        rows = torch.cat(list(segments.ancestors)).to(key.device)
        anc_k = key.index_select(0, rows).split(counts)
        anc_v = value.index_select(0, rows).split(counts)
    if query_pos is None:
        qs: Sequence[Tensor] = query.split(lengths)
        ats: list[Tensor | None] = [None] * len(lengths)
        order = None
    else:
        # Local queries in segment order: one gather here, one at the end to undo it.
        starts = torch.tensor(segments.start, dtype=query_pos.dtype)
        seg_of = torch.searchsorted(starts, query_pos.cpu(), right=True) - 1
        order = torch.argsort(seg_of, stable=True)
        per_seg = torch.bincount(seg_of, minlength=len(lengths)).tolist()
        qs = query.index_select(0, order.to(query.device)).split(per_seg)
        ats = list(query_pos.cpu()[order].split(per_seg))
    outs = []
    for i, (s, e) in enumerate(zip(segments.start, segments.end, strict=True)):
        q = qs[i]
        if q.shape[0] == 0:
            continue
        at = ats[i]
        if counts[i] == 0 and at is None:
            # A root segment, whole: plain causal attention (the flat path).
            outs.append(_attend(q, own_k[i], own_v[i], None, scale, dropout_p))
            continue
        if at is None:
            at = torch.arange(s, e)
        # True = attend: every ancestor, and the segment's own rows up to the query's.
        mine = torch.arange(s, e)[None, :] <= at[:, None]
        mask = torch.cat([mine.new_ones(at.numel(), counts[i]), mine], dim=1).to(query.device)
        k = torch.cat([anc_k[i], own_k[i]]) if counts[i] else own_k[i]
        v = torch.cat([anc_v[i], own_v[i]]) if counts[i] else own_v[i]
        outs.append(_attend(q, k, v, mask, scale, dropout_p))
    out = torch.cat(outs)
    if order is None:
        return out
    # Under CP the segments tile the trie, so every local row is in exactly one of them.
    return out.index_select(0, torch.argsort(order).to(out.device))


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, p: float) -> Tensor:
    """``q [n, np, hn]``, ``k/v [m, ng, hn]`` -> ``[n, np, hn]``; causal when ``mask`` is None."""
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return sdpa(q4, k4, v4, scale=scale, dropout_p=p, mask=mask)[0].transpose(0, 1)
