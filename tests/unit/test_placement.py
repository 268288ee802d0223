"""Rank placement: whole tensor-parallel groups per node, nodes filled in rank order."""

from __future__ import annotations

import pytest

from trainctl.workers.control.placement import Node, plan
from trainctl.workers.engine.config import ConfigError


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
