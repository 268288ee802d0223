"""Recovery from live peers: when a rank is lost, the training state the surviving ranks
still hold in memory, copied before they are replaced, rebuilds the new group with no step
lost (``recovery.py`` falls back to the newest checkpoint when this cannot be done).

Without ZeRO-1 every DP x CP replica holds the whole state of its model-parallel
coordinate (TP, PP and EP rank): the parameters, their fp32 masters and AdamW's moments.
So for each coordinate one survivor writes its pieces in the reshardable format as if it
were replica 0 (``ShardCheckpoint.reshardable_state(as_replica0=True)``), into Ray's object
store: the copies are owned by the controller and outlive the ranks that made them. The new
ranks cut their shards out of those copies exactly as out of a checkpoint's files.

Imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.engine.boundary import PeerStep, RankMeta
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

PROBE_S = 10.0
"""How long a survivor may take to answer; a rank still stuck in a collective after this
counts as lost."""


@dataclass(frozen=True)
class PeerCopy:
    """The survivors' state, in the object store: the step they agree on, the ranks that
    wrote a copy (one per model-parallel coordinate) and references to the copies."""

    step: int
    ranks: list[int]
    states: list[Any]


@dataclass(frozen=True)
class NoPeerCopy:
    """Why the survivors' state cannot rebuild the group (the checkpoint must)."""

    reason: str


def coordinate(meta: RankMeta) -> tuple[int, int, int]:
    """A rank's model-parallel coordinate (TP, PP, EP): the ranks that share it hold the same
    state when the optimizer is replicated."""
    c = meta.coords
    return (c.tp, c.pp, c.ep)


def stand_ins(
    metas: list[RankMeta], alive: dict[int, PeerStep]
) -> tuple[dict[tuple[int, int, int], int], list[tuple[int, int, int]]]:
    """For each model-parallel coordinate, the lowest surviving rank that holds it; and the
    coordinates no survivor holds."""
    chosen: dict[tuple[int, int, int], int] = {}
    for rank, meta in enumerate(metas):
        if rank in alive:
            chosen.setdefault(coordinate(meta), rank)
    missing = sorted({coordinate(m) for m in metas} - chosen.keys())
    return chosen, missing


def agreed_step(alive: dict[int, PeerStep]) -> int | str:
    """The step every survivor is at (the base's and every adapter's), or why there is none."""
    if not alive:
        return "no rank survived"
    kinds = {(s.step, tuple(sorted(s.adapters.items()))) for s in alive.values()}
    if len(kinds) > 1:
        steps = {rank: s.step for rank, s in sorted(alive.items())}
        return f"the survivors disagree on the step (rank: step {steps}, adapters included)"
    return next(iter(alive.values())).step


async def copy_from_survivors(
    group: RankGroup, *, zero: bool, timeout_s: float
) -> PeerCopy | NoPeerCopy:
    """Every surviving rank drops its gradients and says its step; if they agree and every
    model-parallel coordinate has a survivor, one survivor per coordinate copies its state
    into the object store. ``zero``: ZeRO-1 (no survivor holds a lost rank's optimizer
    range). Changes no survivor's weights."""
    if zero:
        return NoPeerCopy(
            "ZeRO-1 (the distributed optimizer) keeps one copy of each rank's optimizer state: "
            "a lost rank's is held by no survivor"
        )
    if not group.ranks:
        return NoPeerCopy("no ranks were running")
    alive = await group.answers(RankWorker.peer_step, timeout_s=PROBE_S)
    step = agreed_step(alive)
    if isinstance(step, str):
        return NoPeerCopy(step)
    chosen, missing = stand_ins(group.meta, alive)
    if missing:
        tp, pp, ep = missing[0]
        return NoPeerCopy(
            f"no rank survived at tp={tp}, pp={pp}, ep={ep} ({len(missing)} coordinate(s) lost "
            "with every replica)"
        )
    ranks = sorted(chosen.values())
    steps, states = await group.keep(ranks, RankWorker.peer_state, timeout_s=timeout_s)
    if set(steps) != {step}:
        return NoPeerCopy(f"the survivors' copies are at steps {sorted(set(steps))}, not {step}")
    log.warning(
        "copied the training state of step %d from surviving rank(s) %s (of %d alive)",
        step,
        ranks,
        len(alive),
    )
    return PeerCopy(step=step, ranks=ranks, states=states)
