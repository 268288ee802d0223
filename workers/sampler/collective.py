"""Weights over a collective: a gloo group of the ranks that own the weights and the
sampler engines' model workers, and a version's buckets sent through it.

The plan (``stream.py``) is known to every member before a byte moves: the controller makes
it, hands each owner its buckets and every receiver the whole plan with the sync's one call,
and all walk it in the same order. Each owner sends its own buckets to every receiver, a few
messages each (never one call per tensor), converting its next bucket while the last is on
its way; the owners send side by side. A receiver assembles every bucket and only then does
anything with them (``receive`` returns the whole set or raises): a send that breaks half-way
leaves the weights it serves untouched.

A group lives for one generation: it is formed when the engines start (or one is
recreated), behind a store key prefixed with a secret (``Rendezvous.prefix``), as the ranks'
own rendezvous is. A new generation is a new group; members of an old one are never mixed in.

Torch only: this module imports nothing from vLLM, so the sending side needs no vLLM.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainctl.workers import rendezvous
from trainctl.workers.sampler.buckets import Assembler, Values, pack
from trainctl.workers.sampler.stream import StreamPlan


@dataclass(frozen=True)
class Rendezvous:
    """Where a group forms: the sender's store, a secret key prefix, the member count and
    the generation. Plain values: it travels to every member as a dict."""

    host: str
    port: int
    prefix: str
    world_size: int
    """Every owner that sends (trainer rank 0 first) and every receiver."""
    generation: int
    timeout_s: float = 120.0
    backend: str = "gloo"
    """The wire the group speaks (``wires.WIRES``): ``gloo`` is this module's group; ``nccl``
    is vLLM's, formed at a store of vLLM's own on this host and port
    (``workers/sampler/vllm_backend/nccl_sender.py``)."""
    bucket_bytes: int = 0
    """``nccl``: the bytes of vLLM's packed broadcast buffers, which both ends must agree on."""

    @staticmethod
    def new(host: str, port: int, world: int, generation: int, **kw: Any) -> Rendezvous:
        return Rendezvous(host, port, secrets.token_hex(16), world, generation, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Joined:
    """A member's gloo group and what reaches its store (rank 0: the store itself, behind
    the sender's gate; the others: a door to that gate). Owns them: ``close`` when done."""

    group: Any
    store: Any
    door: rendezvous.Door | None = None

    def close(self) -> None:
        if self.door is not None:
            self.door.close()


def open_group(rv: Rendezvous, rank: int, gate: rendezvous.Gate | None = None) -> Joined:
    """This member's gloo group (rank 0: the sender, whose process hosts the store behind
    ``gate``, which only members that know ``rv.prefix`` get through; the others reach it
    through a door). Blocks until every member has joined, at most ``rv.timeout_s``."""
    timeout = timedelta(seconds=rv.timeout_s)
    door = None
    if rank == 0:
        if gate is None:
            raise ValueError("the group's rank 0 hosts the store: it needs its gate")
        store = rendezvous.master_store(rv.world_size, rv.timeout_s)
        gate.open(int(store.port))
    else:
        store, door = rendezvous.member_store(
            rv.host, rv.port, rv.prefix, rv.world_size, rv.timeout_s
        )
    prefixed = dist.PrefixStore(f"trainctl-weights/{rv.prefix}/{rv.generation}", store)
    group: Any = dist.ProcessGroupGloo(prefixed, rank, rv.world_size, timeout)
    # A group that moves nothing must fail here, not serve stale weights (vLLM's own NCCL
    # communicator turns itself off silently on a CPU): the generation goes round first.
    token = torch.tensor([rv.generation if rank == 0 else -1], dtype=torch.int64)
    group.broadcast(token, 0).wait()
    if int(token) != rv.generation:
        raise RuntimeError(
            f"the weights' group moved nothing: generation {int(token)}, not {rv.generation}"
        )
    return Joined(group, store, door)


def send(
    group: Any,
    plan: StreamPlan,
    owner: int,
    receivers: Sequence[int],
    values: Values,
    after_bucket: Callable[[int], None] | None = None,
) -> tuple[int, float]:
    """Owner ``owner``'s side of a sync: each of its buckets packed (``buckets.pack``) and
    sent to every receiver (their ranks in the group), converting the next bucket while the
    last one is on its way; the bytes sent to each, and the seconds converting. A receiver
    that fails (it died, or stopped past the group's timeout) is dropped and the others get
    every bucket; then a ``LostReceivers`` names it. ``after_bucket(i)`` runs once the
    owner's bucket ``i`` is on its way (a drill's stall)."""
    sent, convert_s = 0, 0.0
    lost: dict[int, str] = {}
    live = list(receivers)
    in_flight: list[tuple[int, Any]] = []

    def settle() -> None:
        for dst, work in in_flight:
            try:
                work.wait()
            except Exception as e:  # that receiver left: the others go on
                lost.setdefault(dst, f"{type(e).__name__}: {e}")
        live[:] = [d for d in live if d not in lost]
        if not live:
            raise LostReceivers(lost)

    for k, (index, bucket) in enumerate(plan.of_owner(owner)):
        t0 = time.perf_counter()
        messages = pack(bucket, values)
        convert_s += time.perf_counter() - t0
        settle()
        in_flight = []
        for tag, m in zip(plan.tags(index), messages, strict=True):
            for dst in live:
                try:
                    in_flight.append((dst, group.send([m], dst, tag)))
                except Exception as e:
                    lost.setdefault(dst, f"{type(e).__name__}: {e}")
        sent += sum(m.numel() for m in messages)
        if after_bucket is not None:
            after_bucket(k)
    settle()
    if lost:
        raise LostReceivers(lost)
    return sent, convert_s


class LostReceivers(RuntimeError):
    """Receivers of a send that failed, by their rank in the group, with why; the others got
    everything."""

    def __init__(self, lost: dict[int, str]) -> None:
        self.lost = lost
        why = "; ".join(f"rank {r}: {e}" for r, e in sorted(lost.items()))
        super().__init__(f"{len(lost)} receiver(s) left the weights' group: {why}")


@dataclass
class Posted:
    """One bucket's receives, posted into its buffers (``Assembler.buffers``)."""

    index: int
    buffers: list[Tensor]
    works: list[Any]

    @staticmethod
    def post(group: Any, assembler: Assembler, index: int, src: int) -> Posted:
        """Post bucket ``index``'s receives from ``src`` (its owner's rank in ``group``), one
        per message, each tagged as the plan says."""
        buffers = assembler.buffers(index)
        tags = assembler.plan.tags(index)
        works = [group.recv([b], src, tag) for b, tag in zip(buffers, tags, strict=True)]
        return Posted(index, buffers, works)

    def land(self, assembler: Assembler) -> int:
        """Wait for every message, then put the bucket in place; its bytes."""
        for work in self.works:
            work.wait()
        assembler.placed_into(self.index, self.buffers)
        return sum(b.numel() for b in self.buffers)


def receive(group: Any, plan: StreamPlan) -> dict[str, Tensor]:
    """A receiver's side of ``send``: every bucket of every owner received (all posted at
    once, so the owners send side by side), assembled into whole tensors. Returns only once
    all have arrived (a failed send raises)."""
    assembler = Assembler(plan)
    posted = [
        Posted.post(group, assembler, index, plan.owners.index(bucket.owner))
        for index, bucket in enumerate(plan.buckets)
    ]
    for p in posted:
        p.land(assembler)
    return assembler.tensors()


class Sender:
    """An owner's end of the collective, in its rank's actor. Owns the group of its
    generation (joined on the first send, kept for the next ones) and the plan staged for the
    next send.
    Trainer rank 0 is the group's rank 0 and hosts its store (``rendezvous``); every other
    owner joins by what rank 0 made. A send that fails drops the group: the next sync forms
    a new generation."""

    def __init__(self) -> None:
        self.rv: Rendezvous | None = None
        self.rank = 0
        """This owner's rank in the group."""
        self.gate: rendezvous.Gate | None = None
        """Rank 0: the gate in front of the store, on the node's address alone (never every
        interface, which torch's own store would take), admitting members only."""
        self.group: Joined | None = None
        self.staged: tuple[StreamPlan, int, list[int], Values] | None = None

    def rendezvous(
        self, host: str, world: int, generation: int, timeout_s: float, bucket_bytes: int = 0
    ) -> Rendezvous:
        """Rank 0: where the group of ``generation`` (``world`` members) forms, a new store
        for a new generation; each of its operations waits for a member at most
        ``timeout_s``. ``bucket_bytes``: the plan's, for the record (gloo needs no buffers
        agreed on)."""
        if self.rv is None or (self.rv.generation, self.rv.world_size) != (generation, world):
            import socket

            self.close()
            rv = Rendezvous.new(
                host, 0, world, generation, timeout_s=timeout_s, bucket_bytes=bucket_bytes
            )
            self.gate = rendezvous.Gate(socket.create_server((host, 0), backlog=128), rv.prefix)
            self.rv = replace(rv, port=self.gate.port)
        return self.rv

    def join(self, rv: dict[str, Any], rank: int) -> None:
        """Every other owner: the group rank 0 made (a new one drops the old)."""
        new = Rendezvous(**rv)
        if new != self.rv:
            self.close()
            self.rv, self.rank = new, rank

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        if self.gate is not None:
            self.gate.close()
        self.group, self.rv, self.gate = None, None, None

    def stage(self, plan: StreamPlan, owner: int, receivers: list[int], values: Values) -> None:
        self.staged = (plan, owner, receivers, values)

    def send(self, after_bucket: Callable[[int], None] | None = None) -> tuple[int, float]:
        """Send this owner's buckets of the staged plan (joining the group first if new);
        the bytes sent to each receiver, and the seconds converting."""
        if self.staged is None or self.rv is None:
            raise RuntimeError("nothing staged to send")
        (plan, owner, receivers, values), self.staged = self.staged, None
        try:
            if self.group is None:
                self.group = open_group(self.rv, self.rank, self.gate)
            return send(self.group.group, plan, owner, receivers, values, after_bucket)
        except Exception:
            self.close()
            raise
