"""The parallel math over real gloo ranks against float64 single-process references.

Acceptance tests of docs/algorithms.md §7: T1.5-T1.11, T2.2, T3.1-T3.2 (TP), T4.1-T4.4, T5.2, plus
the RL losses (importance sampling, PPO, KL) under every normalisation at dp2 x cp2 and cp4.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from helpers.rankpool import RankPool
from ops_cases import (
    aggregate_case,
    cp_loss_case,
    eval_reduce_case,
    fused_head_tp_case,
    logprob_tp_case,
    reassemble_grad_case,
    zero_valid_shard_case,
)
from pp_cases import pp_broadcast_case, pp_broadcast_refused_case
from stats_cases import ppl_uneven_case, scalar_mean_case, stats_case
from sync_cases import dp_sync_dummy_case, grouped_ddp_case

Pools = Callable[[int], RankPool]


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("oov", [False, True])
def test_t3_1_t3_2_tp_logprob_matches_full_vocab(pools: Pools, t: int, oov: bool) -> None:
    results = pools(t).run(logprob_tp_case, 4, 30, 256, 7, oov)
    cols = sorted(r["columns"] for r in results)
    coverage = [0] * 256
    for a, b in cols:
        for j in range(a, b):
            coverage[j] += 1
    assert coverage == [1] * 256  # the vocab slices tile [0, V) exactly once


def test_fused_head_at_tp2_matches_the_full_vocabulary(pools: Pools) -> None:
    results = pools(2).run(fused_head_tp_case, 600, 32, 256, 256)
    assert sorted(r["columns"] for r in results) == [(0, 128), (128, 256)]


LOSSES = [("cross_entropy", 0.0), ("importance_sampling", 0.0), ("ppo", 0.0), ("ppo", 0.05)]
NORMS = ["token_mean", "seq_mean_token_mean", "sum"]


@pytest.mark.parametrize(("kind", "kl"), LOSSES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(("dp", "cp"), [(2, 2), (1, 4)])
def test_t1_5_cp_local_loss_equals_global(
    pools: Pools, dp: int, cp: int, kind: str, norm: str, kl: float
) -> None:
    results = pools(dp * cp).run(cp_loss_case, dp, cp, kind, norm, kl)
    assert len({r["loss"] for r in results}) == 1
    assert sum(r["local_valid"] for r in results) > 0


def test_t1_6_zero_valid_shard(pools: Pools) -> None:
    r0, r1 = pools(2).run(zero_valid_shard_case)
    assert r0["valid"] == 0 and r1["valid"] > 0
    assert r0["loss"] == 0.0 and r0["grads_none"] == [] and r0["all_zero"]
    assert r1["grads_none"] == [] and not r1["all_zero"]


def test_t1_7_eval_reduce_group(pools: Pools) -> None:
    results = pools(4).run(eval_reduce_case)
    for r in results:
        assert abs(r["dpcp"] - r["global"]) < 1e-12
        assert abs(r["dp_only"] - r["global"]) > 1e-6  # one CP slice is not the mean


def test_dp_cp_aggregation_is_the_global_loss(pools: Pools) -> None:
    """``ops.aggregate.aggregate_loss``: the DP x CP sum of every rank's loss shares (a dummy
    micro-batch's zero included) is the single-process loss, the same on every rank."""
    results = pools(4).run(aggregate_case)
    assert len({r["aggregate"] for r in results}) == 1
    for r in results:
        assert r["reference"] > 0
        assert abs(r["aggregate"] - r["reference"]) <= 1e-12 * r["reference"]
        assert abs(r["dp_only"] - r["reference"]) > 1e-6  # a CP slice alone is not the loss


def test_t1_8_to_t1_10_stats_are_cp_invariant(pools: Pools) -> None:
    base = pools(1).run(stats_case)[0]
    assert base["n_valid_tokens:sum"] > 0 and base["prompt_tokens:sum"] > 0
    for c in (2, 4):
        for got in pools(c).run(stats_case):
            assert got.keys() == base.keys()
            for k, v in base.items():
                if k.endswith(":sum"):  # counts: exactly equal
                    assert got[k] == v, (c, k)
                else:
                    assert abs(got[k] - v) <= 1e-6 * max(1.0, abs(v)), (c, k, got[k], v)


def test_t1_10_ppl_uneven_split(pools: Pools) -> None:
    for ppl in pools(2).run(ppl_uneven_case):
        assert abs(ppl - math.exp(0.5)) < 1e-9


def test_t1_11_reassemble_grad(pools: Pools) -> None:
    for r in pools(2).run(reassemble_grad_case):
        assert r == {"weighted_ok": True, "uniform_ok": True}


def test_t2_2_dp_sync_with_dummy(pools: Pools) -> None:
    assert pools(2).run(dp_sync_dummy_case) == [True, True]


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_t4_1_t4_2_every_stage_gets_metadata(pools: Pools, pp: int) -> None:
    results = pools(2 * pp).run(pp_broadcast_case, 2, pp, [3, 5])
    roles = {r[0]["role"] for r in results}
    expected = {1: {"only"}, 2: {"first", "last"}, 4: {"first", "intermediate", "last"}}[pp]
    assert roles == expected
    for per_rank in results:  # variable length: 3 then 5 sequences
        assert [len(r["cu"]) for r in per_rank] == [4, 6]


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_tree_metadata_reaches_every_stage_and_tp_rank(pools: Pools, pp: int) -> None:
    """Prefix-trie micro-batches: the segment table (and the position ids, which are depths)
    reach every TP rank of every stage, intermediate ones included; the rows and the loss
    positions, more of them than rows, reach the last stage."""
    results = pools(2 * pp).run(pp_broadcast_case, 2, pp, [3, 5], True, False, True)
    for per_rank in results:
        assert [r["segments"] for r in per_rank] == [11, 17]  # variable length, per batch


@pytest.mark.parametrize("pp", [1, 4])
def test_collated_cu_seqlens_reach_every_tp_rank_as_one_shape(pools: Pools, pp: int) -> None:
    """megatron collates cu_seqlens as [1, n]: every TP rank, the sender included, holds the
    same 1-D [n] tensor."""
    results = pools(2 * pp).run(pp_broadcast_case, 2, pp, [3, 5], True, True)
    shapes = {r["cu_shape"] for per_rank in results for r in per_rank}
    assert shapes == {(4,), (6,)}
    for per_rank in results:
        assert [r["cu_shape"] for r in per_rank] == [(4,), (6,)]


def test_cu_seqlens_of_several_rows_are_refused_on_every_tp_rank(pools: Pools) -> None:
    assert pools(2).run(pp_broadcast_refused_case) == [
        "cu_seqlens must be [n] or [1, n], got shape (2, 4)",
        "TP source rank 0 refused its cu_seqlens",
    ]


def test_scalar_mean_over_ranks(pools: Pools) -> None:
    assert pools(2).run(scalar_mean_case) == [2.0, 2.0]


def test_t4_3_none_protocol(pools: Pools) -> None:
    for per_rank in pools(4).run(pp_broadcast_case, 2, 2, [3], False):
        assert per_rank[0]["cu"] is None


def test_t5_2_grouped_linear_ddp_no_hang(pools: Pools) -> None:
    assert pools(2).run(grouped_ddp_case) == [True, True]
