"""The dispatch plan: split a global batch over DP ranks and cut it into micro-batches.

Pure host-side numpy, run once per step by the controller:
1. sequences go to DP ranks greedily by padded length, longest first, each to the rank with
   the fewest tokens so far (balanced by token count);
2. each rank's sequences are cut into micro-batches under a token budget (first-fit decreasing);
3. ranks with fewer micro-batches get dummy micro-batches so every rank runs the same number
   (their collectives stay in step; docs/algorithms.md §2);
4. the loss normalisers (global counts of loss tokens and sequences) are computed once, here,
   and folded into a per-token ``loss_scale``, so every rank's local loss sum adds up to the
   single-process loss.

With ``packing="tree"`` the units of steps 1 and 2 are prefix tries instead of sequences
(``workers/control/trie.py``): sequences sharing a prefix travel together, and a micro-batch
whose tries share anything carries a ``TreeLayout`` (the model computes each shared token
once; the loss side stays per sequence). A batch in which nothing is shared is planned exactly
as ``flat``.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from trainctl.api.batch import TokenSequence
from trainctl.api.fields import LOSS_INPUTS
from trainctl.api.models import LossConfig, Normalization
from trainctl.workers.control.trie import Trie, build_tries, tree_layout
from trainctl.workers.engine.boundary import PACKED_FIELDS, PackedMicroBatch, TreeLayout
from trainctl.workers.engine.config import LINEAR_TREE, EngineConfig
from trainctl.workers.rank.step_plan import StepPlan

CROSS_ENTROPY = LossConfig()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sequence_scales(
    seqs: Sequence[TokenSequence], normalization: Normalization, *, deferred: bool = False
) -> tuple[list[float], int, int]:
    """Per-sequence factor on ``mask * weight``, from the *global* batch; plus N and S.

    token_mean: ``1 / N`` (N = loss tokens of the batch); seq_mean_token_mean:
    ``1 / (S * n_i)`` (S = sequences with a loss token, ``n_i`` = loss tokens of sequence
    ``i``); sum: 1. Every rank multiplies its local terms by these: the sum over all ranks is
    the single-process loss, whatever the split. ``deferred`` (a ``forward_backward`` part):
    the batch-wide divisor (N or S) is left out, to be applied once to the whole window
    (docs/algorithms.md §11).
    """
    counts = [s.num_loss_tokens for s in seqs]
    n_tokens, n_seqs = sum(counts), sum(c > 0 for c in counts)
    tokens_div = 1 if deferred else max(n_tokens, 1)
    seqs_div = 1 if deferred else max(n_seqs, 1)
    if normalization is Normalization.TOKEN_MEAN:
        scales = [1.0 / tokens_div] * len(seqs)
    elif normalization is Normalization.SEQ_MEAN_TOKEN_MEAN:
        scales = [1.0 / (seqs_div * c) if c else 0.0 for c in counts]
    else:
        scales = [1.0] * len(seqs)
    return scales, n_tokens, n_seqs


def pack(
    seqs: Sequence[TokenSequence],
    indices: Sequence[int],
    *,
    pad_multiple: int,
    scales: Sequence[float] | None = None,
    total_len: int | None = None,
) -> PackedMicroBatch:
    """Pack sequences into one micro-batch, each right-padded to ``pad_multiple``.

    ``scales[i]`` multiplies sequence ``i``'s ``mask * weight`` into ``loss_scale`` (default
    1). If ``total_len`` is given (pipeline parallelism needs one shape for every micro-batch),
    a trailing pad-only sequence fills the pack up to it.
    """
    scales = [1.0] * len(seqs) if scales is None else scales
    present = _loss_inputs(seqs[0]) if seqs else []
    route_shape = _route_shape(seqs)
    routes: list[np.ndarray] = []
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (*PACKED_FIELDS, *present)}
    cu: list[int] = [0]
    seq_lens: list[int] = []

    def add(n: int, padded: int, values: dict[str, np.ndarray]) -> None:
        if route_shape is not None:  # not rolled: the routes of the token the row computes
            given = values.pop("routed_experts", None)
            routes.append(_pad_routes(given, padded, route_shape))
        for k, v in values.items():
            cols[k].append(np.pad(v, (0, padded - n)))
        cols["position_ids"].append(np.arange(padded, dtype=np.int64))
        cols["seq_id"].append(np.full(padded, len(seq_lens), dtype=np.int64))
        cu.append(cu[-1] + padded)
        seq_lens.append(n)

    for seq, scale in zip(seqs, scales, strict=True):
        n = len(seq)
        mask = _rolled(seq.loss_mask, n).astype(np.float32)
        weight = mask if seq.weights is None else mask * _rolled(seq.weights, n)
        values = {
            "input_ids": seq.tokens.astype(np.int64),
            "labels": _rolled(seq.tokens, n).astype(np.int64),
            "loss_mask": mask,
            # float64: 1/N in fp32 would cost ~1e-7 relative on the loss of every rank.
            "loss_scale": weight.astype(np.float64) * scale,
        }
        for k in present:
            values[k] = _rolled(seq.get(k), n).astype(np.float32)
        if route_shape is not None:
            values["routed_experts"] = seq.routed_experts
        add(n, _round_up(n, pad_multiple), values)
    index = list(indices)
    if total_len is not None and total_len > cu[-1]:
        fill = total_len - cu[-1]
        if fill % pad_multiple:
            raise ValueError(f"trailing pad {fill} is not a multiple of {pad_multiple}")
        zeros = np.zeros(0, np.float32)  # add() pads every column out to `fill`
        values = {
            "input_ids": zeros.astype(np.int64),
            "labels": zeros.astype(np.int64),
            "loss_mask": zeros,
            "loss_scale": zeros.astype(np.float64),
            **{k: zeros for k in present},
        }
        add(0, fill, values)
        index.append(-1)
    per_token: dict[str, np.ndarray] = {k: np.concatenate(v) for k, v in cols.items()}
    if routes:
        per_token["routed_experts"] = np.concatenate(routes)
    return PackedMicroBatch(
        per_token=per_token,
        cu_seqlens=np.asarray(cu, dtype=np.int32),
        seq_index=np.asarray(index, dtype=np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
    )


def _rolled(x: np.ndarray | None, n: int) -> np.ndarray:
    """``x`` shifted so position ``t`` holds token ``t+1``'s value; 0 at the last position
    (the mask is 0 there, so it never counts). ``None`` (a mask of all ones) as ones."""
    out = np.zeros(n, np.float64 if x is None else x.dtype)
    out[:-1] = 1 if x is None else x[1:]
    return out


def _loss_inputs(seq: TokenSequence) -> list[str]:
    return [k for k in LOSS_INPUTS if seq.get(k) is not None]


def _route_shape(seqs: Sequence[TokenSequence]) -> tuple[int, int] | None:
    """``(layers, top_k)`` of the batch's ``routed_experts``; None when it carries none."""
    given = seqs[0].get("routed_experts") if seqs else None
    return None if given is None else (int(given.shape[1]), int(given.shape[2]))


def _pad_routes(given: np.ndarray | None, length: int, shape: tuple[int, int]) -> np.ndarray:
    """``[length, layers, top_k]`` int64: ``given``'s rows, then pad rows routed to experts
    ``0..top_k-1`` (distinct, as every row must be; a pad's output reaches no loss)."""
    out = np.broadcast_to(np.arange(shape[1], dtype=np.int64), (length, *shape)).copy()
    if given is not None:
        out[: len(given)] = given
    return out


def dummy_microbatch(
    *,
    length: int,
    loss_inputs: Sequence[str] = (),
    route_shape: tuple[int, int] | None = None,
) -> PackedMicroBatch:
    """A pad-only micro-batch of ``length`` tokens that contributes zero loss."""
    z = np.zeros(length, np.float32)
    per_token: dict[str, np.ndarray] = {
        "input_ids": z.astype(np.int64),
        "position_ids": np.arange(length, dtype=np.int64),
        "labels": z.astype(np.int64),
        "loss_mask": z,
        "loss_scale": z.astype(np.float64),
        "seq_id": np.zeros(length, np.int64),
        **{k: z for k in loss_inputs},
    }
    if route_shape is not None:
        per_token["routed_experts"] = _pad_routes(None, length, route_shape)
    return PackedMicroBatch(
        per_token=per_token,
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
    seqs: Sequence[TokenSequence],
    *,
    dp: int,
    max_tokens_per_microbatch: int,
    pad_multiple: int,
    uniform_length: bool = False,
    loss: LossConfig = CROSS_ENTROPY,
    microbatch_multiple: int = 1,
    packing: str = "flat",
    deferred_normalizer: bool = False,
) -> StepPlan:
    """Build the step plan; ``loss`` carries the normalisation. ``uniform_length`` pads every
    micro-batch to one length (PP); ``microbatch_multiple`` rounds the micro-batch count up
    (the interleaved PP schedule needs a multiple of the pipeline size); ``packing`` is
    ``flat`` or ``tree`` (prefix tries); ``deferred_normalizer``: see ``sequence_scales``."""
    if not seqs:
        raise ValueError("empty batch")
    present = _loss_inputs(seqs[0])
    for i, s in enumerate(seqs):
        if _loss_inputs(s) != present:
            raise ValueError(f"sequence {i} carries other per-token loss inputs than sequence 0")
    scales, n_tokens, n_seqs = sequence_scales(
        seqs, loss.normalization, deferred=deferred_normalizer
    )
    padded = [_round_up(len(s), pad_multiple) for s in seqs]
    if max(padded) > max_tokens_per_microbatch:
        raise ValueError(
            f"a sequence of {max(padded)} padded tokens exceeds the micro-batch budget "
            f"{max_tokens_per_microbatch}"
        )
    tries: list[Trie] = []
    if packing == "tree":
        tries = build_tries(
            [s.tokens for s in seqs], budget=max_tokens_per_microbatch, pad_multiple=pad_multiple
        )
        tries.sort(key=lambda t: min(t.members))  # request order, as far as sharing allows
        if not any(t.branches for t in tries):
            tries = []  # nothing shared: exactly the flat plan
    elif packing != "flat":
        raise ValueError(f"packing must be 'flat' or 'tree', got {packing!r}")
    # The units dispatched: tries, or single sequences.
    units = [list(t.members) for t in tries] or [[i] for i in range(len(seqs))]
    unit_len = [_round_up(t.size, pad_multiple) for t in tries] or padded
    groups = [
        cut_microbatches(shard, unit_len, max_tokens_per_microbatch)
        for shard in balance_over_dp(unit_len, dp)
    ]
    num_mb = _round_up(max(1, max(len(g) for g in groups)), microbatch_multiple)
    total_len = None
    if uniform_length:
        total_len = max(sum(unit_len[u] for u in mb) for g in groups for mb in g)
    dummy_len = total_len or pad_multiple
    route_shape = _route_shape(seqs)
    shards = []
    for g in groups:
        mbs = []
        for mb in g:
            members = [i for u in mb for i in units[u]]
            shared = bool(tries) and any(tries[u].branches for u in mb)
            packed = pack(
                [seqs[i] for i in members],
                members,
                pad_multiple=pad_multiple,
                scales=[scales[i] for i in members],
                total_len=None if shared else total_len,
            )
            if shared:
                tree = tree_layout(
                    [tries[u] for u in mb], pad_multiple=pad_multiple, total_len=total_len
                )
                if "routed_experts" in packed.per_token:
                    tree = dataclasses.replace(tree, routes=trie_routes(packed, tree))
                packed = dataclasses.replace(packed, tree=tree)
            mbs.append(packed)
        mbs += [
            dummy_microbatch(length=dummy_len, loss_inputs=present, route_shape=route_shape)
            for _ in range(num_mb - len(mbs))
        ]
        shards.append(tuple(mbs))
    missing = [k for k in loss.required_inputs() if k not in present]
    if missing:
        raise ValueError(f"the {loss.kind.value} loss needs per-token {', '.join(missing)}")
    return StepPlan(
        loss=loss,
        microbatches=tuple(shards),
        loss_normalizer=float(n_tokens),
        num_loss_sequences=n_seqs,
        num_sequences=len(seqs),
        num_tokens=sum(len(s) for s in seqs),
    )


def trie_routes(packed: PackedMicroBatch, tree: TreeLayout) -> np.ndarray:
    """``[trie rows, layers, top_k]``: the routes of each trie row, from the member sequences'
    (a shared row is computed once, so it takes one route). Sequences through a shared row
    that give it different routes cannot be packed together: a ValueError names them."""
    flat = packed.per_token["routed_experts"]
    shape = (int(flat.shape[1]), int(flat.shape[2]))
    seq = packed.seq_id
    real = packed.position_ids < packed.seq_lens[seq]  # a sequence's tokens, not its pads
    rows = tree.rows[real]
    out = _pad_routes(None, tree.num_tokens, shape)
    out[rows] = flat[real]  # a shared row: one of its sequences' routes
    clash = (out[rows] != flat[real]).any(axis=(1, 2))
    if clash.any():
        j = int(np.flatnonzero(clash)[0])
        position = int(packed.position_ids[real][j])
        mine = int(seq[real][j])
        theirs = int(seq[real][(rows == rows[j]) & ~clash][0])
        a, b = sorted(int(packed.seq_index[k]) for k in (mine, theirs))
        raise ValueError(
            f"sequences[{a}] and sequences[{b}] share a prefix but carry different "
            f"routed_experts at token {position}: a shared token is computed once, on one "
            "route; send them with packing 'flat', or with the same routes on the prefix"
        )
    return out


def _packing(cfg: EngineConfig, packing: str | None) -> str:
    if packing == "tree" and cfg.model.linear_layers:
        raise ValueError(f"packing: {LINEAR_TREE}")
    return packing or cfg.default_packing


def plan_step(
    seqs: Sequence[TokenSequence],
    cfg: EngineConfig,
    *,
    loss: LossConfig = CROSS_ENTROPY,
    packing: str | None = None,
    deferred_normalizer: bool = False,
) -> StepPlan:
    """``make_plan`` with everything the engine's layout dictates; ``packing`` defaults to
    the engine config's."""
    lay = cfg.layout
    return make_plan(
        seqs,
        dp=lay.dp,
        max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
        pad_multiple=cfg.pad_multiple,
        # PP sends fixed-shape activations; MoE's all-gather dispatcher gathers equal-sized
        # token blocks over the EP group.
        uniform_length=lay.pp > 1 or lay.ep > 1,
        loss=loss,
        microbatch_multiple=lay.pp if lay.vp > 1 else 1,
        packing=_packing(cfg, packing),
        deferred_normalizer=deferred_normalizer,
    )
