"""Rank placement: whole tensor-parallel groups per node, nodes filled in rank order."""

from __future__ import annotations

import dataclasses

import pytest

from trainctl.workers.control.placement import Node, fewer_replicas, plan
from trainctl.workers.engine.config import ConfigError, ModelConfig, ParallelLayout


def _nodes(*slots: int) -> list[Node]:
    return [Node(f"n{i}", f"10.0.0.{i}", s) for i, s in enumerate(slots)]


def test_consecutive_ranks_fill_each_node_with_whole_tp_groups() -> None:
    got = plan(8, 2, _nodes(4, 4))
    assert [(p.node.node_id, list(p.ranks)) for p in got] == [
        ("n0", [0, 1, 2, 3]),
        ("n1", [4, 5, 6, 7]),
    ]


def test_a_node_with_an_odd_slot_left_takes_only_whole_groups() -> None:
    got = plan(4, 2, _nodes(3, 3))  # 3 slots: one TP group of 2, the third slot unused
    assert [list(p.ranks) for p in got] == [[0, 1], [2, 3]]
    for p in got:
        assert p.ranks.start % 2 == 0 and len(p.ranks) % 2 == 0  # no TP group straddles


def test_unused_nodes_are_left_out() -> None:
    assert [p.node.node_id for p in plan(2, 1, _nodes(2, 2, 2))] == ["n0"]


@pytest.mark.parametrize(
    ("world", "tp", "slots", "words"),
    [
        (4, 4, (2, 2), "tp=4: a tensor-parallel group must sit on one node, but the largest "
         "node has 2 rank slot(s)"),
        (8, 2, (2, 3), "8 ranks need 8 slots in whole tensor-parallel groups of 2, but the "
         "cluster's nodes give 4 (10.0.0.0: 2, 10.0.0.1: 3)"),
        (2, 1, (), "no node has a free slot"),
    ],
)  # fmt: skip
def test_a_layout_that_cannot_be_placed_is_refused_with_its_numbers(
    world: int, tp: int, slots: tuple[int, ...], words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        plan(world, tp, _nodes(*slots))
    assert words in str(e.value)


def test_with_moe_whole_expert_parallel_groups_stay_on_a_node_too() -> None:
    """Experts are whole on each rank (expert TP = 1), so an EP group is ``ep`` consecutive
    ranks: at tp=2, ep=4 a node takes runs of lcm = 4."""
    got = plan(8, 2, _nodes(6, 6), ep=4)
    assert [list(p.ranks) for p in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="run of 4 ranks holding whole tensor-parallel"):
        plan(8, 2, _nodes(2, 2, 2, 2), ep=4)


# -- --on-node-loss shrink: fewer DP replicas, every model-parallel group kept ----------------


def _model(**kw: int) -> ModelConfig:
    return ModelConfig(**kw)


@pytest.mark.parametrize(
    ("layout", "slots", "dp"),
    [
        (ParallelLayout(dp=3), (1, 1), 2),  # a node of three lost
        (ParallelLayout(dp=3), (1, 1, 1), 3),  # all there: the layout itself
        (ParallelLayout(dp=3, tp=2), (2, 2, 1), 2),  # the odd slot holds no TP group
        (ParallelLayout(dp=4, tp=2, pp=2), (4, 3, 4), 2),  # pp=2 x tp=2: 4 ranks a replica
    ],
)
def test_the_most_replicas_the_nodes_hold_with_tp_and_pp_kept(
    layout: ParallelLayout, slots: tuple[int, ...], dp: int
) -> None:
    got = fewer_replicas(layout, _model(num_layers=2), _nodes(*slots))
    assert got == dataclasses.replace(layout, dp=dp)


def test_expert_parallel_groups_stay_whole_when_replicas_go() -> None:
    """Each EP group of two on one node. With pp=2 one replica is one rank a stage, half an
    EP group (ep=2 must divide dp * cp * tp = 1): a node of two slots holds no layout."""
    moe = _model(num_experts=4, num_layers=2)
    got = fewer_replicas(ParallelLayout(dp=6, ep=2), moe, _nodes(2, 2, 1))
    assert got == ParallelLayout(dp=4, ep=2)  # five slots: two whole EP groups
    with pytest.raises(ConfigError, match="4 ranks need 4 slots"):
        fewer_replicas(ParallelLayout(dp=2, pp=2, ep=2), moe, _nodes(2))


def test_when_not_one_replica_fits_the_configured_layout_is_refused_with_its_numbers() -> None:
    with pytest.raises(ConfigError, match="tp=2: a tensor-parallel group must sit on one node"):
        fewer_replicas(ParallelLayout(dp=2, tp=2), _model(), _nodes(1, 1))
