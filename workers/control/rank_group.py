"""The rank group: one Ray actor per global rank, and every call that goes to all of them.

It places the actors (a placement group, one bundle per rank), forms the process group,
builds every engine shard, and calls a method on every rank at once. A failure is classified
here: a dead rank, or peers still blocked in a collective ``FAILURE_GRACE_S`` after a rank
failed, mean the group is lost (``GroupLostError``: the controller rebuilds it); a rank that
raised and left the group healthy is a ``WorkerError`` naming it. Imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainctl.api import NotReadyError, TrainctlError, WorkerError
from trainctl.workers import spans
from trainctl.workers.control import placement
from trainctl.workers.control.group import GroupLostError
from trainctl.workers.engine.boundary import RankMeta
from trainctl.workers.engine.config import ConfigError, EngineConfig
from trainctl.workers.rank.export import Part
from trainctl.workers.rank.worker import RankWorker
from trainctl.workers.sampler.spec import SAMPLER_NODE_RESOURCE

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


@dataclass(frozen=True)
class Pending(Generic[R]):
    """A rank's answer of type ``R``, still in the object store: ``RankGroup.fetch`` awaits
    it."""

    ref: Any


log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 10.0
"""After one rank fails, how long the others may take before the group counts as wedged."""
_FORWARDED_ENV = ("TRAINCTL_LOG_LEVEL", "TRAINCTL_LOG_FORMAT", *spans.ENV)


class RankGroup:
    """The one door to the rank actors. Owns the actors, their placement group, their
    ``RankMeta``, the layout they run and the classification of their failures."""

    def __init__(self, cfg: EngineConfig, *, num_cpus: float, num_gpus: float = 0.0) -> None:
        self.configured = cfg
        """The config asked for at start, its layout included."""
        self.cfg = cfg
        """The config the ranks run: ``configured``, or with fewer DP replicas while the live
        nodes cannot hold it (``place(shrink=True)``). The one owner of the current layout:
        the step plans and the checkpoints' headers read it here."""
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.ranks: list[Any] = []
        self.meta: list[RankMeta] = []
        """Per rank, from its build: coordinates, parameters, pid, node."""
        self.plan: list[placement.NodeRanks] = []
        self.pgs: list[Any] = []
        """One placement group per node of the plan."""

    @property
    def world_size(self) -> int:
        return self.cfg.layout.world_size

    def nodes(self) -> list[placement.Node]:
        """The cluster's live nodes and their rank slots: GPUs over ``num_gpus`` on GPU
        nodes, else CPUs over ``num_cpus``; in a fixed order (address, then node id). Nodes
        kept for samplers (``SAMPLER_NODE_RESOURCE``) hold no rank."""
        out = []
        nodes: Callable[[], list[dict[str, Any]]] = ray.nodes  # untyped in Ray
        for n in nodes():
            res = n.get("Resources", {}) if n.get("Alive") else {}
            if SAMPLER_NODE_RESOURCE in res:
                continue  # kept for the sampler engines
            if self.num_gpus:
                slots = int(res.get("GPU", 0.0) / self.num_gpus + 1e-9)
            else:
                slots = int(res.get("CPU", 0.0) / self.num_cpus + 1e-9)
            if slots:
                out.append(placement.Node(n["NodeID"], n.get("NodeManagerAddress", "?"), slots))
        return sorted(out, key=lambda n: (n.address, n.node_id))

    @property
    def shrunk(self) -> bool:
        """Whether the ranks run fewer DP replicas than configured."""
        return self.cfg.layout != self.configured.layout

    def holds_configured(self) -> bool:
        """Whether the live nodes hold the configured layout (counting the slots the ranks
        hold now as free: a rebuild releases them first)."""
        lay = self.configured.layout
        try:
            placement.plan(lay.world_size, lay.tp, self.nodes(), ep=lay.ep)
        except ConfigError:
            return False
        return True

    async def place(self, *, shrink: bool = False) -> None:
        """Reserve one bundle per rank, each node's ranks in one ``STRICT_PACK`` placement
        group pinned to it (``placement.py``), for the configured layout; ``shrink``: for the
        largest one with fewer DP replicas that the live nodes hold, if the configured one
        does not fit (``cfg`` says which). A ``ConfigError`` naming the numbers if the
        cluster cannot hold it."""
        nodes = self.nodes()
        lay = self.configured.layout
        if shrink:
            lay = placement.fewer_replicas(lay, self.configured.model, nodes)
        self.plan = placement.plan(lay.world_size, lay.tp, nodes, ep=lay.ep)
        if lay != self.cfg.layout:
            log.warning(
                "the ranks run %s (configured: %s)", lay.describe(),
                self.configured.layout.describe(),
            )  # fmt: skip
        self.cfg = dataclasses.replace(self.configured, layout=lay)
        world = self.world_size
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus  # one rank per GPU on GPU nodes
        self.pgs = [
            placement_group(
                [bundle] * len(part.ranks),
                strategy="STRICT_PACK",
                bundle_label_selector=[{NODE_ID_LABEL_KEY: part.node.node_id}] * len(part.ranks),
            )
            for part in self.plan
        ]
        try:
            await asyncio.wait_for(
                asyncio.gather(*[pg.ready() for pg in self.pgs]), timeout=PLACEMENT_TIMEOUT_S
            )
        except asyncio.TimeoutError:
            self.release()
            raise NotReadyError(
                f"the {world} rank actors could not be placed within {PLACEMENT_TIMEOUT_S:.0f}s "
                f"({world} x {bundle}; some of the nodes' resources may be in use)"
            ) from None
        log.info(
            "placed %d ranks on %d node(s): %s",
            world,
            len(self.plan),
            ", ".join(
                f"{p.node.address} ranks {p.ranks.start}-{p.ranks.stop - 1}" for p in self.plan
            ),
        )

    def release(self) -> None:
        """Free the placement groups."""
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []

    def _slot(self, rank: int) -> PlacementGroupSchedulingStrategy:
        for part, pg in zip(self.plan, self.pgs, strict=True):
            if rank in part.ranks:
                return PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank - part.ranks.start
                )
        raise AssertionError(f"rank {rank} has no slot")

    async def spawn(self) -> None:
        """Create one rank actor per bundle, form the process group, build every shard."""
        world = self.world_size
        actor_cls = ray.remote(RankWorker)
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        self.ranks = [
            actor_cls.options(
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                scheduling_strategy=self._slot(i),
                runtime_env={"env_vars": env},
            ).remote(i, world)
            for i in range(world)
        ]
        timeout = self.cfg.collective_timeout_s
        host, port, secret = await self.ranks[0].rendezvous_address.remote(timeout)
        await asyncio.gather(
            *[
                r.init_process_group.remote(host, port, secret, self.cfg.backend, timeout)
                for r in self.ranks
            ]
        )
        log.info("process group formed at %s:%d; building engine shards", host, port)
        self.meta = await asyncio.gather(*[r.build.remote(self.cfg) for r in self.ranks])

    def kill(self, *, release: bool = False) -> None:
        """Stop every rank actor; ``release`` also frees the placement group."""
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.ranks = []
        if release:
            self.release()

    def put(self, value: Any) -> Any:
        return ray.put(value)

    async def call(
        self, method: Callable[Concatenate[RankWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """``method`` (a ``RankWorker`` method) on every rank; the results in rank order, or
        the failure classified (``_classified``)."""
        return await self._classified(list(enumerate(self.ranks)), method.__name__, args, kwargs)

    async def call_one(
        self,
        rank: int,
        method: Callable[Concatenate[RankWorker, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``method`` on rank ``rank`` alone (rank-0 work, a fault injection), its failure
        classified as ``call``'s."""
        got = await self._classified([(rank, self.ranks[rank])], method.__name__, args, kwargs)
        return cast(R, got[0])

    def gather_on_rank0(
        self,
        part: Part,
        adapter: str | None,
        merge: Callable[Concatenate[RankWorker, list[Any], P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Pending[R]:
        """Every rank's ``canonical_shards(part, adapter)``, left in the object store, handed
        as one list to rank 0's ``merge(parts, *args, **kwargs)``: its answer, not awaited, so
        the controller never holds the tensors (``fetch`` awaits it)."""
        return Pending(self._merged_on_rank0(part, adapter, merge, args, kwargs, 1))

    def gather_on_rank0_split(
        self,
        part: Part,
        adapter: str | None,
        merge: Callable[Concatenate[RankWorker, list[Any], P], tuple[Any, S]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[Any, Pending[S]]:
        """``gather_on_rank0`` for a ``merge`` of two returns: a reference to the first, left
        in the object store for others to read (the samplers), and the second to ``fetch``."""
        kept, small = self._merged_on_rank0(part, adapter, merge, args, kwargs, 2)
        return kept, Pending(small)

    def _merged_on_rank0(
        self,
        part: Part,
        adapter: str | None,
        merge: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        num_returns: int,
    ) -> Any:
        parts = [r.canonical_shards.remote(part, adapter) for r in self.ranks]
        remote = getattr(self.ranks[0], merge.__name__)
        if num_returns != 1:
            remote = remote.options(num_returns=num_returns)
        return remote.remote(parts, *args, **kwargs)

    async def fetch(self, pending: Pending[R], what: str) -> R:
        """The value of a ``gather_on_rank0`` answer; a dead rank is the group lost, a rank's
        own error a ``WorkerError`` naming ``what``."""
        try:
            return cast(R, await pending.ref)
        except ray.exceptions.RayActorError as e:
            cause = f"a rank died during {what}"
            raise GroupLostError(
                f"{cause}; nothing was applied. The workers are being rebuilt (from the "
                "surviving ranks' state, else the latest checkpoint): retry shortly",
                details={"error": str(e).splitlines()[0]},
                cause=cause,
            ) from None
        except ray.exceptions.RayTaskError as e:
            c = getattr(e, "cause", None)
            if isinstance(c, TrainctlError):
                raise c from None
            raise WorkerError(f"{what} failed: {type(c).__name__}: {c}") from None

    async def _classified(
        self, ranks: list[tuple[int, Any]], name: str, args: Any, kwargs: Any
    ) -> list[Any]:
        """``name`` on each ``(rank, actor)``; the results in that order. A rank that died or
        peers stuck past ``FAILURE_GRACE_S``: the group is lost (``GroupLostError``); a rank's
        own ``TrainctlError`` as it is; any other failure a ``WorkerError`` naming the rank."""
        tasks = [asyncio.ensure_future(getattr(r, name).remote(*args, **kwargs)) for _, r in ranks]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
        failed = {
            rank: t.exception()
            for (rank, _), t in zip(ranks, tasks, strict=True)
            if t.done() and t.exception() is not None
        }
        if not failed and not pending:
            return [t.result() for t in tasks]
        for t in pending:
            t.cancel()
        dead = [r for r, e in failed.items() if isinstance(e, ray.exceptions.RayActorError)]
        causes = {
            rank: f"{type(c).__name__}: {c}"
            for rank, e in failed.items()
            for c in [getattr(e, "cause", None) or e]
        }
        if dead or pending:
            what = f"rank(s) {dead} died" if dead else f"rank(s) {sorted(causes)} failed"
            stuck = f", {len(pending)} rank(s) stuck" if pending else ""
            cause = f"{what} during {name}{stuck}"
            raise GroupLostError(
                f"{cause}; nothing was applied. The workers are being rebuilt (from the "
                "surviving ranks' state, else the latest checkpoint): retry shortly",
                details={"ranks": dead or sorted(causes), "method": name, "causes": causes},
                cause=cause,
            )
        for e in failed.values():
            c = getattr(e, "cause", None)
            if isinstance(c, TrainctlError):
                raise c
        first = min(causes)
        raise WorkerError(
            f"rank {first} failed in {name}: {causes[first]}"
            + (f" (and {len(causes) - 1} more rank(s))" if len(causes) > 1 else ""),
            details={"method": name, "ranks": {str(r): c for r, c in causes.items()}},
        )

    async def answers(self, method: Callable[[RankWorker], R], *, timeout_s: float) -> dict[int, R]:
        """``method`` on every rank; the answers of the ranks that gave one within
        ``timeout_s``, by rank. A dead, stuck or failing rank gives none (a survey after a
        failure, not a step: nothing here is a ``GroupLostError``)."""
        tasks = [asyncio.ensure_future(getattr(r, method.__name__).remote()) for r in self.ranks]
        if not tasks:
            return {}
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        return {
            rank: t.result()
            for rank, t in enumerate(tasks)
            if t.done() and not t.cancelled() and t.exception() is None
        }

    async def keep(
        self,
        ranks: list[int],
        method: Callable[[RankWorker], tuple[R, Any]],
        *,
        timeout_s: float,
    ) -> tuple[list[R], list[Any]]:
        """``method`` (two returns: a small one, then a large one) on each of ``ranks``: the
        small returns, awaited, and references to the large ones, left in the object store
        and never fetched here. They are owned by this process, so they outlive the ranks
        that made them (until these references are dropped). A failure is a
        ``WorkerError``."""
        calls = [
            getattr(self.ranks[r], method.__name__).options(num_returns=2).remote() for r in ranks
        ]
        try:
            small = await asyncio.wait_for(
                asyncio.gather(*[c[0] for c in calls]), timeout=timeout_s
            )
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            raise WorkerError(
                f"{method.__name__} on ranks {ranks} failed: {type(e).__name__}: {e}"
            ) from None
        return list(small), [c[1] for c in calls]

    async def call_quietly(self, method: Callable[..., Any]) -> None:
        """``method`` on every rank that still answers; failures ignored (cleanup)."""
        name = method.__name__
        await asyncio.gather(
            *[getattr(r, name).remote() for r in self.ranks], return_exceptions=True
        )

    def replica0(self, per_rank: list[Any]) -> list[Any]:
        """The items of ``per_rank`` (one per rank, in rank order) of DP x CP replica 0: one
        full copy of the model across TP and PP."""
        return [
            item
            for item, m in zip(per_rank, self.meta, strict=True)
            if m.coords.dp == 0 and m.coords.cp == 0
        ]

    def digest_of(self, digests: list[str]) -> str:
        """One sha256 over the replica-0 shards' digests: equal digests, equal weights."""
        return hashlib.sha256("".join(self.replica0(digests)).encode()).hexdigest()

    async def digests(self) -> list[str]:
        return await self.call(RankWorker.weights_digest)

    def parameters_per_replica(self) -> int:
        return sum(m.parameters for m in self.replica0(self.meta))
