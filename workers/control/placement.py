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

import dataclasses
import math
from dataclasses import dataclass

from trainctl.workers.engine.config import ConfigError, ModelConfig, ParallelLayout


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


def plan(world: int, tp: int, nodes: list[Node], ep: int = 1) -> list[NodeRanks]:
    """Consecutive runs of whole groups, one run per node, in node order (the order given);
    a ``ConfigError`` naming the numbers if the layout cannot be placed.

    The group is the TP group, or with MoE the run of ``lcm(tp, ep)`` ranks that holds whole
    TP groups and whole EP groups: experts are not tensor-parallel here (expert TP = 1), so
    megatron's EP groups are ``ep`` consecutive ranks too, and their all-to-alls (every MoE
    layer) stay on the node as well."""
    unit = math.lcm(tp, ep)
    what = f"tensor-parallel group of {tp}" if unit == tp else (
        f"run of {unit} ranks holding whole tensor-parallel (tp={tp}) and expert-parallel "
        f"(ep={ep}) groups"
    )  # fmt: skip
    if world % unit:
        raise ConfigError(f"world size {world} is not a multiple of a {what}")
    largest = max((n.slots for n in nodes), default=0)
    if unit > largest:
        label = f"tp={tp}: a tensor-parallel group" if unit == tp else f"a {what}"
        raise ConfigError(
            f"{label} must sit on one node, but the largest node has {largest} rank slot(s) "
            f"({_describe(nodes)}); lower tp{'' if unit == tp else ' or ep'} or use larger nodes"
        )
    out: list[NodeRanks] = []
    start = 0
    for n in nodes:
        take = min(n.slots // unit * unit, world - start)
        if take:
            out.append(NodeRanks(n, range(start, start + take)))
            start += take
    if start < world:
        usable = sum(n.slots // unit * unit for n in nodes)
        groups = f"tensor-parallel groups of {tp}" if unit == tp else f"runs of {unit}"
        raise ConfigError(
            f"{world} ranks need {world} slots in whole {groups}, but the cluster's nodes give "
            f"{usable} ({_describe(nodes)}): add nodes or lower the parallel sizes"
        )
    return out


def fewer_replicas(layout: ParallelLayout, model: ModelConfig, nodes: list[Node]) -> ParallelLayout:
    """The layout with the most DP replicas, ``layout``'s at most, that ``nodes`` hold and
    the model takes: tp, cp, pp, ep and vp kept, so whole replicas go and every model-parallel
    group stays as it was (``--on-node-loss shrink``). ``layout`` itself when it fits; a
    ``ConfigError`` (``plan``'s, for ``layout``) when not even one replica does."""
    for dp in range(layout.dp, 0, -1):
        smaller = dataclasses.replace(layout, dp=dp)
        try:
            smaller.validate(model)  # ep must still divide dp * cp * tp
            plan(smaller.world_size, smaller.tp, nodes, ep=smaller.ep)
        except ConfigError:
            continue
        return smaller
    plan(layout.world_size, layout.tp, nodes, ep=layout.ep)  # raises, naming the numbers
    raise AssertionError("unreachable: a layout that places also shrinks to itself")


def _describe(nodes: list[Node]) -> str:
    if not nodes:
        return "no node has a free slot"
    return ", ".join(f"{n.address}: {n.slots}" for n in nodes)
