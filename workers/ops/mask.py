"""Blockwise construction of the causal mask for packed and prefix-shared (trie) layouts
(docs/algorithms.md §2.3).

``mask[i, j]`` is True where packed position ``i`` may attend to position ``j``. For each
sequence, given its packed positions ``pos[0..L)`` in order (possibly non-contiguous trie
segments), ``mask[pos[a], pos[b]] = True`` for every ``b <= a``. The mask itself is ``N x N``
bool either way; building it by blocks of ``BLOCK`` rows keeps the temporary *index* memory at
``O(BLOCK^2)`` instead of ``O(N^2)`` (``tril_indices(N, N)`` alone is 4 GiB at N = 32K); each
block is written a quarter of its rows at a time, so the index pairs torch materialises for a
write stay near 17 MB.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

BLOCK = 2048
"""Rows per block: about 17 MB of int32 triangle indices plus 34 MB of int64 positions."""


def blockwise_causal_mask(
    seq_positions: Sequence[Tensor], n: int, *, block: int | None = None
) -> Tensor:
    """``[n, n]`` bool mask: causal within each sequence, nothing across sequences."""
    b = block or BLOCK
    q = max(1, b // 4)  # rows per write: index temporaries stay ~17 MB at b = 2048
    mask = torch.zeros(n, n, dtype=torch.bool)
    for pos in seq_positions:
        pos = pos.to(torch.long)
        length = pos.numel()
        for r0 in range(0, length, b):
            rows = pos[r0 : r0 + b]
            for q0 in range(0, rows.numel(), q):  # the diagonal block, a quarter at a time
                sub = rows[q0 : q0 + q]
                tri = torch.tril_indices(sub.numel(), sub.numel(), dtype=torch.int32)
                mask[sub[tri[0]], sub[tri[1]]] = True  # its own rows: lower-triangular
                del tri
                if q0:
                    mask[sub[:, None], rows[None, :q0]] = True  # earlier rows of the block
            for c0 in range(0, r0, b):  # blocks left of the diagonal: dense
                cols = pos[c0 : c0 + b][None, :]
                for q0 in range(0, rows.numel(), q):
                    mask[rows[q0 : q0 + q, None], cols] = True
    return mask
