"""Blockwise construction of the causal mask for packed and prefix-shared (trie) layouts (§2.3).

``mask[i, j]`` is True where packed position ``i`` may attend to position ``j``. For each
sequence, given its packed positions ``pos[0..L)`` in order (possibly non-contiguous trie
segments), ``mask[pos[a], pos[b]] = True`` for every ``b <= a``. The mask itself is ``N x N``
bool either way; building it by blocks of ``BLOCK`` rows keeps the temporary *index* memory at
``O(BLOCK^2)`` instead of ``O(N^2)`` (``tril_indices(N, N)`` alone is 4 GiB at N = 32K).
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
    mask = torch.zeros(n, n, dtype=torch.bool)
    for pos in seq_positions:
        pos = pos.to(torch.long)
        length = pos.numel()
        for r0 in range(0, length, b):
            rows = pos[r0 : r0 + b]
            tri = torch.tril_indices(rows.numel(), rows.numel())
            mask[rows[tri[0]], rows[tri[1]]] = True  # the diagonal block: lower-triangular
            for c0 in range(0, r0, b):  # blocks left of the diagonal: dense
                mask[rows[:, None], pos[c0 : c0 + b][None, :]] = True
    return mask
