"""The dispatch plan: split a global batch over DP ranks and cut it into micro-batches.

Pure host-side numpy, run once per step by the controller:
1. sequences go to DP ranks greedily by padded length, longest first, each to the rank with
   the fewest tokens so far (balanced by token count);
2. each rank's sequences are cut into micro-batches under a token budget (first-fit decreasing);
3. ranks with fewer micro-batches get dummy micro-batches so every rank runs the same number
   (their collectives stay in step; shared/design/ALGORITHMS.md §2);
4. the loss normaliser (the global count of loss tokens) is computed once, here, so every rank
   scales its local loss sum by the same number.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from trainctl.workers.batch import HostSequence, PackedMicroBatch, StepPlan


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack(
    seqs: Sequence[HostSequence],
    indices: Sequence[int],
    *,
    pad_multiple: int,
    total_len: int | None = None,
) -> PackedMicroBatch:
    """Pack sequences into one micro-batch, each right-padded to ``pad_multiple``.

    If ``total_len`` is given (pipeline parallelism needs one shape for every micro-batch),
    a trailing pad-only sequence fills the pack up to it.
    """
    parts_ids, parts_pos, parts_lab, parts_w = [], [], [], []
    cu = [0]
    seq_lens = []
    for seq in seqs:
        n = len(seq)
        padded = _round_up(n, pad_multiple)
        labels, weight = seq.rolled()
        pad = padded - n
        parts_ids.append(np.pad(seq.tokens, (0, pad)))
        parts_pos.append(np.arange(padded, dtype=np.int64))
        parts_lab.append(np.pad(labels, (0, pad)))
        parts_w.append(np.pad(weight, (0, pad)))
        cu.append(cu[-1] + padded)
        seq_lens.append(n)
    index = list(indices)
    if total_len is not None and total_len > cu[-1]:
        fill = total_len - cu[-1]
        if fill % pad_multiple:
            raise ValueError(f"trailing pad {fill} is not a multiple of {pad_multiple}")
        parts_ids.append(np.zeros(fill, np.int64))
        parts_pos.append(np.arange(fill, dtype=np.int64))
        parts_lab.append(np.zeros(fill, np.int64))
        parts_w.append(np.zeros(fill, np.float32))
        cu.append(cu[-1] + fill)
        seq_lens.append(0)
        index.append(-1)
    return PackedMicroBatch(
        input_ids=np.concatenate(parts_ids).astype(np.int64),
        position_ids=np.concatenate(parts_pos),
        labels=np.concatenate(parts_lab).astype(np.int64),
        loss_weight=np.concatenate(parts_w).astype(np.float32),
        cu_seqlens=np.asarray(cu, dtype=np.int32),
        seq_index=np.asarray(index, dtype=np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
    )


def dummy_microbatch(*, length: int) -> PackedMicroBatch:
    """A pad-only micro-batch of ``length`` tokens that contributes zero loss."""
    z = np.zeros(length, np.int64)
    return PackedMicroBatch(
        input_ids=z,
        position_ids=np.arange(length, dtype=np.int64),
        labels=z.copy(),
        loss_weight=np.zeros(length, np.float32),
        cu_seqlens=np.asarray([0, length], np.int32),
        seq_index=np.asarray([-1], np.int64),
        seq_lens=np.asarray([0], np.int64),
        is_dummy=True,
    )


def balance_over_dp(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Assign sequence indices to ``dp`` ranks, longest first to the least-loaded rank."""
    heap = [(0, r) for r in range(dp)]
    shards: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(s) for s in shards]


def cut_microbatches(
    indices: Sequence[int], lengths: Sequence[int], budget: int
) -> list[list[int]]:
    """First-fit decreasing bins of padded length <= ``budget``; request order inside a bin."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def make_plan(
    seqs: Sequence[HostSequence],
    *,
    dp: int,
    max_tokens_per_microbatch: int,
    pad_multiple: int,
    uniform_length: bool = False,
) -> StepPlan:
    """Build the step plan. ``uniform_length`` pads every micro-batch to one length (PP)."""
    if not seqs:
        raise ValueError("empty batch")
    padded = [_round_up(len(s), pad_multiple) for s in seqs]
    if max(padded) > max_tokens_per_microbatch:
        raise ValueError(
            f"a sequence of {max(padded)} padded tokens exceeds the micro-batch budget "
            f"{max_tokens_per_microbatch}"
        )
    groups = [
        cut_microbatches(shard, padded, max_tokens_per_microbatch)
        for shard in balance_over_dp(padded, dp)
    ]
    num_mb = max(1, max(len(g) for g in groups))
    total_len = None
    if uniform_length:
        total_len = max(sum(padded[i] for i in mb) for g in groups for mb in g)
    dummy_len = total_len or pad_multiple
    shards = []
    for g in groups:
        mbs = [
            pack([seqs[i] for i in mb], mb, pad_multiple=pad_multiple, total_len=total_len)
            for mb in g
        ]
        mbs += [dummy_microbatch(length=dummy_len) for _ in range(num_mb - len(mbs))]
        shards.append(tuple(mbs))
    num_loss = sum(s.num_loss_tokens for s in seqs)
    return StepPlan(
        microbatches=tuple(shards),
        loss_normalizer=float(num_loss),
        num_sequences=len(seqs),
        num_tokens=sum(len(s) for s in seqs),
        num_loss_tokens=num_loss,
    )
