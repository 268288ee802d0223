"""Prefix tries: sequences that share a prefix are packed so the prefix is computed once.

numpy only, run by the controller while planning (docs/algorithms.md §10).

Sorted lexicographically, sequences that share a prefix are neighbours, and the longest prefix
a sequence shares with any sequence before it is the one it shares with its predecessor
(``lcp``). Appending each sequence's unshared suffix ``s[lcp:]`` in that order lays the trie out
in depth-first order. Each such suffix is a *segment*: a chain of tokens whose ancestors are
the first ``lcp`` tokens of its sequence, already laid out by earlier segments. So

* a sequence's tokens sit at model rows ``rows(s) = rows(prev)[:lcp] ++ arange(a, b)``, where
  ``[a, b)`` is its segment: the row map from its flat positions to the trie (a duplicate's
  segment is empty and its rows are its twin's);
* the segment's ancestry is ``rows(s)[:lcp]``: each of its tokens attends to those and, causally,
  to its own segment - exactly its ancestors and itself;
* every token's position id is its depth, its position in each sequence through it.

A trie grows while its padded size fits the micro-batch budget; a sequence that would overflow
it starts a new trie (sharing is then recomputed, never lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainctl.workers.engine.boundary import TreeLayout


@dataclass(frozen=True, kw_only=True)
class Trie:
    """Sequences packed into one prefix trie, laid out depth-first."""

    members: tuple[int, ...]
    """Indices (into the list given to ``build_tries``) of the sequences through the trie, in
    the order their segments were laid out."""
    tokens: np.ndarray  # [n] int64, depth-first
    depth: np.ndarray  # [n] int64, position id of each token
    rows: tuple[np.ndarray, ...]
    """Per member: ``[len(member)]`` int64, the trie row of each of its tokens."""
    seg_start: np.ndarray  # [k] int64, segment boundaries (non-empty segments only)
    seg_end: np.ndarray  # [k] int64
    seg_ancestors: tuple[np.ndarray, ...]
    """Per segment: the trie rows of its ancestors (root first)."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def branches(self) -> bool:
        """Whether any token is shared (a chain of one sequence is a plain sequence)."""
        return len(self.members) > 1


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_tries(tokens: Sequence[np.ndarray], *, budget: int, pad_multiple: int = 1) -> list[Trie]:
    """Group ``tokens`` (one array per sequence) into tries of padded size <= ``budget``.

    A sequence that shares no prefix with its sorted predecessor starts a trie of its own, so
    sequences without any sharing come back one per trie, as plain sequences.
    """
    # Big-endian bytes of non-negative ids sort as the id sequences do (a prefix first).
    keys = [t.astype(">i8").tobytes() for t in tokens]
    order = sorted(range(len(tokens)), key=keys.__getitem__)
    groups: list[list[tuple[int, int]]] = []  # [(sequence, lcp with the previous member)]
    size = 0
    prev: np.ndarray | None = None
    for i in order:
        s = tokens[i]
        lcp = _lcp(prev, s) if prev is not None else 0
        if groups and lcp > 0 and _round_up(size + len(s) - lcp, pad_multiple) <= budget:
            groups[-1].append((i, lcp))
            size += len(s) - lcp
        else:
            if len(s) > budget:
                raise ValueError(f"a sequence of {len(s)} tokens exceeds the budget {budget}")
            groups.append([(i, 0)])
            size = len(s)
        prev = s
    return [_lay_out(tokens, g) for g in groups]


def _lay_out(tokens: Sequence[np.ndarray], group: list[tuple[int, int]]) -> Trie:
    parts: list[np.ndarray] = []
    depths: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    starts: list[int] = []
    ends: list[int] = []
    ancestors: list[np.ndarray] = []
    n = 0
    for i, lcp in group:
        s = tokens[i]
        own = np.arange(n, n + len(s) - lcp, dtype=np.int64)
        prefix = rows[-1][:lcp] if rows else np.zeros(0, np.int64)
        rows.append(np.concatenate([prefix, own]))
        if own.size:
            parts.append(s[lcp:].astype(np.int64))
            depths.append(np.arange(lcp, len(s), dtype=np.int64))
            starts.append(n)
            ends.append(n + own.size)
            ancestors.append(prefix)
            n += own.size
    return Trie(
        members=tuple(i for i, _ in group),
        tokens=np.concatenate(parts) if parts else np.zeros(0, np.int64),
        depth=np.concatenate(depths) if depths else np.zeros(0, np.int64),
        rows=tuple(rows),
        seg_start=np.asarray(starts, np.int64),
        seg_end=np.asarray(ends, np.int64),
        seg_ancestors=tuple(ancestors),
    )


def encode_segments(
    starts: np.ndarray, ends: np.ndarray, ancestors: Sequence[np.ndarray]
) -> np.ndarray:
    """The segment table as one int64 array (what travels to every rank):
    ``[k, start(k), end(k), offsets(k + 1), ancestor rows...]``."""
    k = starts.shape[0]
    offsets = np.zeros(k + 1, np.int64)
    offsets[1:] = np.cumsum([a.shape[0] for a in ancestors])
    flat = np.concatenate(list(ancestors)) if k else np.zeros(0, np.int64)
    table: np.ndarray = np.concatenate([[k], starts, ends, offsets, flat]).astype(np.int64)
    return table


def tree_layout(
    tries: Sequence[Trie], *, pad_multiple: int, total_len: int | None = None
) -> TreeLayout:
    """One micro-batch of ``tries``: each padded to ``pad_multiple`` (its pad a segment of its
    own), then a trailing pad up to ``total_len`` if given. ``rows`` follows the flat layout of
    the members trie by trie, member by member, each padded to ``pad_multiple`` as ``pack``
    pads them (pad positions read row 0; their mask is 0)."""
    ids: list[np.ndarray] = []
    pos: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    ancestors: list[np.ndarray] = []
    cu = [0]  # trie boundaries
    end = 0  # rows laid out so far

    def add(tokens: np.ndarray, depth: np.ndarray, start: np.ndarray, stop: np.ndarray) -> None:
        nonlocal end
        ids.append(tokens)
        pos.append(depth)
        starts.append(start + end)
        ends.append(stop + end)
        end += tokens.shape[0]

    def pad(n: int) -> None:
        """n pad tokens: one segment, attending causally to itself only."""
        zero = np.zeros(1, np.int64)
        add(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), zero, zero + n)
        ancestors.append(np.zeros(0, np.int64))

    for t in tries:
        o = end
        ancestors.extend(a + o for a in t.seg_ancestors)
        rows.extend(np.pad(r + o, (0, _round_up(len(r), pad_multiple) - len(r))) for r in t.rows)
        add(t.tokens, t.depth, t.seg_start, t.seg_end)
        if end % pad_multiple:
            pad(_round_up(end, pad_multiple) - end)
        cu.append(end)
    if total_len is not None and total_len > end:
        pad(total_len - end)
        cu.append(end)
    return TreeLayout(
        input_ids=np.concatenate(ids),
        position_ids=np.concatenate(pos),
        cu_seqlens=np.asarray(cu, np.int32),
        segments=encode_segments(np.concatenate(starts), np.concatenate(ends), ancestors),
        rows=np.concatenate(rows),
        computed_tokens=sum(t.size for t in tries),
    )
