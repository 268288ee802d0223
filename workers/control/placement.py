"""Where each rank runs: whole tensor-parallel groups on one node, nodes filled in rank order.

megatron's rank order is tp-cp-ep-dp-pp: TP is fastest, so global ranks ``[k*tp, (k+1)*tp)``
form one TP group, and its all-reduces (several per layer) must stay on a node (NVLink, not
the network). The plan fills the nodes in order with consecutive ranks, as many whole TP
groups as each node has slots for, so that every node holds whole TP groups and, where they
fit, whole pipeline stages (PP is slowest: a stage is a run of consecutive ranks).

Pure (no Ray): ``RankGroup`` reads the nodes from Ray and turns each node's ranks into a
``STRICT_PACK`` placement group pinned to that node by its ``ray.io/node-id`` label.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.workers.engine.config import ConfigError


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    slots: int
    """Ranks it can host: its GPUs (or CPUs) over one rank's share, or the configured number."""


@dataclass(frozen=True)
class NodeRanks:
    node: Node
    ranks: range


def plan(world: int, tp: int, nodes: list[Node]) -> list[NodeRanks]:
    """Consecutive runs of whole TP groups, one run per node, in node order (the order given);
    a ``ConfigError`` naming the numbers if the layout cannot be placed."""
    if world % tp:
        raise ConfigError(f"world size {world} is not a multiple of tp={tp}")
    largest = max((n.slots for n in nodes), default=0)
    if tp > largest:
        raise ConfigError(
            f"tp={tp}: a tensor-parallel group must sit on one node, but the largest node has "
            f"{largest} rank slot(s) ({_describe(nodes)}); lower tp or use larger nodes"
        )
    out: list[NodeRanks] = []
    start = 0
    for n in nodes:
        take = min(n.slots // tp * tp, world - start)
        if take:
            out.append(NodeRanks(n, range(start, start + take)))
            start += take
    if start < world:
        usable = sum(n.slots // tp * tp for n in nodes)
        raise ConfigError(
            f"{world} ranks need {world} slots in whole tensor-parallel groups of {tp}, but the "
            f"cluster's nodes give {usable} ({_describe(nodes)}): add nodes or lower the "
            "parallel sizes"
        )
    return out


def _describe(nodes: list[Node]) -> str:
    if not nodes:
        return "no node has a free slot"
    return ", ".join(f"{n.address}: {n.slots}" for n in nodes)
