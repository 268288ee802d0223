"""The host-side dispatch plan: packing, rolling, DP balance, micro-batches and dummies."""

from __future__ import annotations

import numpy as np
import pytest

from trainctl.api import LossConfig, TokenSequence
from trainctl.api.models import LossKind, Normalization
from trainctl.workers.control.plan import balance_over_dp, make_plan, pack


def seq(tokens: list[int], mask: list[int] | None = None, w: list[float] | None = None):
    n = len(tokens)
    return TokenSequence(
        tokens=np.asarray(tokens, np.int64),
        loss_mask=np.asarray(mask if mask is not None else [1] * n, np.float32),
        weights=None if w is None else np.asarray(w, np.float32),
    )


def test_pack_rolls_labels_and_masks_per_sequence() -> None:
    a = seq([10, 11, 12, 13, 14], [0, 0, 1, 1, 1])
    b = seq([20, 21, 22], [0, 1, 1], [1.0, 2.0, 3.0])
    mb = pack([a, b], [0, 1], pad_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 8, 12]
    assert mb.input_ids.tolist() == [10, 11, 12, 13, 14, 0, 0, 0, 20, 21, 22, 0]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    # Where the weight is non-zero, the label is the true next token of the same sequence.
    assert mb.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0]
    assert mb.loss_scale.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 2, 3, 0, 0]
    assert mb.seq_id.tolist() == [0] * 8 + [1] * 4
    for t in np.flatnonzero(mb.loss_mask):
        assert mb.labels[t] == mb.input_ids[t + 1]
    assert mb.seq_lens.tolist() == [5, 3] and mb.seq_index.tolist() == [0, 1]


def test_pack_trailing_pad_sequence() -> None:
    mb = pack([seq([1, 2, 3])], [4], pad_multiple=2, total_len=10)
    assert mb.cu_seqlens.tolist() == [0, 4, 10]
    assert mb.seq_index.tolist() == [4, -1]
    assert mb.loss_mask[4:].sum() == 0 and mb.loss_scale[4:].sum() == 0


def test_balance_over_dp_by_tokens() -> None:
    lengths = [100, 90, 10, 10, 10, 5, 80]
    shards = balance_over_dp(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # LPT bound
    assert sorted(loads) == [135, 170]  # the optimum: {90, 80} against the rest


def test_plan_budget_dummies_and_normalizer() -> None:
    seqs = [seq(list(range(1, n + 1))) for n in (30, 30, 30, 2)]
    plan = make_plan(seqs, dp=2, max_tokens_per_microbatch=32, pad_multiple=1)
    counts = [len(s) for s in plan.microbatches]
    assert counts[0] == counts[1] == plan.num_microbatches
    real = [[mb for mb in shard if not mb.is_dummy] for shard in plan.microbatches]
    assert sorted(len(r) for r in real) == [1, 2]  # [30] [30] | [30 + 2]: one rank gets a dummy
    assert plan.num_dummies == 1
    for shard in plan.microbatches:
        for mb in shard:
            assert mb.num_tokens <= 32
            if mb.is_dummy:
                assert mb.loss_scale.sum() == 0 and mb.num_tokens >= 1
    seen = sorted(i for shard in real for mb in shard for i in mb.seq_index if i >= 0)
    assert seen == [0, 1, 2, 3]
    assert plan.loss_normalizer == 29 * 3 + 1
    assert plan.num_tokens == 92


def test_plan_uniform_length_for_pipeline() -> None:
    seqs = [seq(list(range(1, n + 1))) for n in (7, 3, 12, 5, 9)]
    plan = make_plan(seqs, dp=2, max_tokens_per_microbatch=16, pad_multiple=2, uniform_length=True)
    lengths = {mb.num_tokens for shard in plan.microbatches for mb in shard}
    assert len(lengths) == 1


def test_plan_rejects_oversize_and_empty() -> None:
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        make_plan([seq(list(range(40)))], dp=1, max_tokens_per_microbatch=32, pad_multiple=1)
    with pytest.raises(ValueError, match="empty"):
        make_plan([], dp=1, max_tokens_per_microbatch=32, pad_multiple=1)


@pytest.mark.parametrize("normalization", list(Normalization))
def test_loss_scale_folds_the_global_normaliser(normalization: Normalization) -> None:
    seqs = [seq([1, 2, 3, 4], [0, 1, 1, 1]), seq([5, 6], [0, 1], [1.0, 4.0]), seq([7, 8], [1, 0])]
    plan = make_plan(
        seqs,
        dp=2,
        max_tokens_per_microbatch=8,
        pad_multiple=1,
        loss=LossConfig(normalization=normalization),
    )
    assert (plan.loss_normalizer, plan.num_loss_sequences) == (4, 2)
    scale = {
        int(mb.seq_index[mb.seq_id[t]]): []
        for sh in plan.microbatches
        for mb in sh
        for t in range(mb.num_tokens)
        if mb.seq_index[mb.seq_id[t]] >= 0
    }
    for shard in plan.microbatches:
        for mb in shard:
            for t in range(mb.num_tokens):
                i = int(mb.seq_index[mb.seq_id[t]])
                if i >= 0:
                    scale[i].append(float(mb.loss_scale[t]))
    want = {
        Normalization.TOKEN_MEAN: {0: [1 / 4, 1 / 4, 1 / 4, 0], 1: [4 / 4, 0], 2: [0, 0]},
        Normalization.SEQ_MEAN_TOKEN_MEAN: {0: [1 / 6, 1 / 6, 1 / 6, 0], 1: [4 / 2, 0], 2: [0, 0]},
        Normalization.SUM: {0: [1, 1, 1, 0], 1: [4, 0], 2: [0, 0]},
    }[normalization]
    for i, w in want.items():
        np.testing.assert_allclose(scale[i], w, rtol=1e-7)


def test_plan_requires_the_losses_inputs() -> None:
    with pytest.raises(ValueError, match="needs per-token advantages, old_logprobs"):
        make_plan(
            [seq([1, 2, 3])],
            dp=1,
            max_tokens_per_microbatch=8,
            pad_multiple=1,
            loss=LossConfig(kind=LossKind.PPO),
        )


def _group() -> list[TokenSequence]:
    """Three responses to one 6-token prompt, and one unrelated sequence."""
    prompt = [9, 8, 7, 6, 5, 4]
    return [
        seq([*prompt, 1, 2, 3], [0] * 6 + [1] * 3),
        seq([*prompt, 4], [0] * 6 + [1]),
        seq([*prompt, 5, 6], [0] * 6 + [1] * 2, [0.5] * 8),
        seq([30, 31, 32]),
    ]


def test_tree_plan_shares_prefixes_and_keeps_the_flat_loss_side() -> None:
    seqs = _group()
    flat = make_plan(seqs, dp=1, max_tokens_per_microbatch=64, pad_multiple=2)
    tree = make_plan(seqs, dp=1, max_tokens_per_microbatch=64, pad_multiple=2, packing="tree")
    assert flat.computed_tokens == flat.num_tokens == 9 + 7 + 8 + 3
    assert tree.num_tokens == flat.num_tokens
    assert tree.computed_tokens == 6 + 3 + 1 + 2 + 3  # the prompt once
    assert tree.loss_normalizer == flat.loss_normalizer
    (mb,) = tree.microbatches[0]
    assert mb.tree is not None and mb.model_tokens < mb.num_tokens
    # Each loss position reads the trie row of its own token: the same input token and depth
    # as flat, so it predicts the same label from the same prefix.
    t = mb.tree
    real = mb.loss_scale > 0
    ids = np.asarray(mb.input_ids)
    np.testing.assert_array_equal(t.input_ids[t.rows][real], ids[real])
    np.testing.assert_array_equal(t.position_ids[t.rows][real], mb.position_ids[real])
    assert t.rows.shape == mb.labels.shape and t.rows.max() < t.num_tokens
    assert t.num_tokens % 2 == 0 and t.cu_seqlens[-1] == t.num_tokens
    # The loss side is the flat packing of the same sequences, sequence by sequence.
    (fmb,) = flat.microbatches[0]
    by_seq = {int(i): k for k, i in enumerate(mb.seq_index)}
    for k, i in enumerate(fmb.seq_index.tolist()):
        a = slice(int(fmb.cu_seqlens[k]), int(fmb.cu_seqlens[k + 1]))
        j = by_seq[i]
        b = slice(int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1]))
        for name in ("labels", "loss_mask", "loss_scale"):
            np.testing.assert_array_equal(fmb.per_token[name][a], mb.per_token[name][b])


def test_tree_plan_without_sharing_is_the_flat_plan() -> None:
    seqs = [seq([1, 2, 3]), seq([4, 5]), seq([6, 7, 8, 9])]
    flat = make_plan(seqs, dp=2, max_tokens_per_microbatch=8, pad_multiple=2)
    tree = make_plan(seqs, dp=2, max_tokens_per_microbatch=8, pad_multiple=2, packing="tree")
    for fs, ts in zip(flat.microbatches, tree.microbatches, strict=True):
        for f, t in zip(fs, ts, strict=True):
            assert t.tree is None and t.per_token.keys() == f.per_token.keys()
            for k in f.per_token:
                np.testing.assert_array_equal(t.per_token[k], f.per_token[k])


def test_tree_plan_gives_a_rank_only_dummies_and_pads_uniformly() -> None:
    tree = make_plan(
        _group()[:3], dp=2, max_tokens_per_microbatch=64, pad_multiple=2, packing="tree",
        uniform_length=True,
    )  # fmt: skip
    shards = tree.microbatches
    assert sorted(sum(not mb.is_dummy for mb in s) for s in shards) == [0, 1]
    lengths = {mb.model_tokens for s in shards for mb in s}
    assert len(lengths) == 1  # PP / EP: one shape for every micro-batch, dummies included
    assert tree.computed_tokens == 12


def test_tree_tries_are_padded_for_the_zigzag_split() -> None:
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import ConfigError, EngineConfig, ParallelLayout

    cfg = EngineConfig(layout=ParallelLayout(cp=2))
    (mb,) = plan_step(_group(), cfg, packing="tree").microbatches[0]
    assert mb.tree is not None
    assert all(n % 4 == 0 for n in np.diff(mb.tree.cu_seqlens))  # 2 * cp per trie
    with pytest.raises(ConfigError, match="packing must be one of"):
        EngineConfig(packing="trie").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packing must be 'flat' or 'tree'"):
        make_plan(_group(), dp=1, max_tokens_per_microbatch=64, pad_multiple=1, packing="x")
