"""How a version of the weights travels from the ranks to the sampler engines.

What a version *is* (a ``Shipment``, kept in the pool's window: ``window.py``) is apart from
how it *travels* (a ``WeightTransport``). A transport has three calls, all in the controller:

- ``connect(engines)``: rendezvous with the engines that will receive (a no-op for a
  transport whose engines fetch; for a broadcast, a new *generation* of the group whenever the
  engines that are ready change: a start, a recreation, a send that failed);
- ``send(source, version, adapter)``: has the ranks (a ``WeightSource``, which the controller
  implements with its rank group) prepare one version, and returns its ``Shipment``: a small
  record naming the transport with its handle, never the tensors;
- ``deliver(source, shipment, receive)``: runs the transfer *with* the engines' receive
  (``receive(link)`` has every engine load it; ``link`` says how each one joins): for a
  broadcast the send and the receives block on one another, so neither can complete first.

The engine side is the engine's ``load_weights(shipment, member)``: a shipment it can open
(``open_shipment``, in the process that loads the weights, from shared memory or a file) or
one it receives over a group (``member``: its part of the ``Link``). So the tensors never
travel as arguments of an engine's internal calls (vLLM's model workers take
``collective_rpc`` arguments as plain lists).

The base's weights are never gathered in one place: the ranks that own them convert their
own shards to pieces of the Hugging Face tensors and send those in buckets, by a plan every
receiver gets (``stream.py``); the engine assembles them.

- ``object_store``: each owner puts its buckets in Ray's object store, one converted at a
  time, and each engine reads them from its node's shared memory (Ray copies them across
  nodes). Adapters (a few MB, gathered on rank 0) always travel so.
- ``collective``: each owner sends its buckets over a gloo group to every engine's model
  worker (``collective.py``; the engine side is ``vllm_backend/gloo_engine.py``). A send cannot
  be replayed: each engine keeps the window's versions it received in host memory.
- ``local``: the tensors themselves as the handle, for an engine in the sending process.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from trainctl.workers.sampler.stream import Schema, StreamPlan
from trainctl.workers.sampler.wires import WIRES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shipment:
    """One version of the base's weights, or of one adapter's, on its way to the engines."""

    transport: str
    """The ``WeightTransport`` that sent it (``TRANSPORTS``), which opens it."""
    version: int
    """The optimizer step of these weights (the base's, or the adapter's own)."""
    adapter: str | None
    nbytes: int
    handle: Any
    """The transport's own: for ``object_store`` a Ray object reference."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)
    """This shipment's own: a step names one version only within one line of training (a
    checkpoint load may bring the same step back with other weights)."""


@dataclass(frozen=True)
class Link:
    """A transport's tie to the engines of one generation, as ``deliver`` hands it to their
    receive: where the group forms, and each member engine's rank in it. Plain values."""

    rendezvous: dict[str, Any]
    """``collective.Rendezvous.to_dict()``."""
    ranks: dict[int, int]
    """Each member engine's rank in the group, by engine index (the sender is rank 0)."""

    @property
    def generation(self) -> int:
        return int(self.rendezvous["generation"])

    def member(self, index: int) -> tuple[dict[str, Any], int] | None:
        """What engine ``index`` needs to join (None: it is not a member)."""
        rank = self.ranks.get(index)
        return None if rank is None else (self.rendezvous, rank)


class Engines(Protocol):
    """The sampler engines, as a transport connects to them (the pool implements it)."""

    async def members(self) -> list[tuple[int, int | None]]:
        """``(index, pid)`` of each engine ready to receive now."""
        ...


class WeightSource(Protocol):
    """The ranks, as a transport asks them for weights (the controller implements it)."""

    async def stream_plan(self, bucket_bytes: int) -> StreamPlan:
        """Every owner's pieces of the base's Hugging Face tensors, in buckets
        (``stream.py``); nothing is converted yet."""
        ...

    async def to_object_store(self, plan: StreamPlan) -> list[Any]:
        """Every owner's buckets of ``plan`` put in the object store (side by side, one bucket
        converted at a time on each): the references, in the plan's bucket order."""
        ...

    async def adapter_to_object_store(self, adapter: str) -> tuple[Any, int]:
        """``adapter``'s factors in PEFT's format, gathered on rank 0 (a few MB) and put in
        the object store once: the reference and the size in bytes."""
        ...

    async def open_collective(
        self, plan: StreamPlan, receivers: int, generation: int, timeout_s: float,
        backend: str = "gloo", bucket_bytes: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """Every owner stages its buckets of ``plan`` for ``send_collective``: the rendezvous
        of the group of ``generation`` (its senders, then ``receivers`` engines), whose every
        operation waits for a member at most ``timeout_s``. ``backend``: the wire
        (``wires.py``), with its buffers of ``bucket_bytes``."""
        ...

    async def send_collective(self, plan: StreamPlan) -> int:
        """Every owner of ``plan`` sends what it staged (the engines receive meanwhile); the
        bytes."""
        ...


T = TypeVar("T")
Receive = Callable[[Link | None], Awaitable[T]]
"""Every engine's receive of one shipment, given the link they join by (None: they fetch)."""


class WeightTransport(Protocol):
    name: ClassVar[str]

    async def connect(self, engines: Engines) -> None:
        """Rendezvous with the engines that are ready (before each ``send``)."""
        ...

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        """Have the ranks prepare version ``version`` for the connected engines."""
        ...

    async def deliver(self, source: WeightSource, shipment: Shipment, receive: Receive[T]) -> T:
        """The transfer of ``shipment``, run with the engines' ``receive``: its result."""
        ...

    def open(self, shipment: Shipment) -> Any:
        """In the process that loads the weights: HF-named tensors (a ``PeftAdapter`` for
        an adapter's shipment)."""
        ...


class FetchedTransport:
    """What transports whose engines fetch the shipment themselves share: nothing to connect,
    and a delivery that is the engines' loads alone."""

    async def connect(self, engines: Engines) -> None:
        return None

    async def deliver(self, source: WeightSource, shipment: Shipment, receive: Receive[T]) -> T:
        return await receive(None)


@dataclass(frozen=True)
class Streamed:
    """An object-store shipment of the base's weights: the plan, and each of its buckets'
    object (its messages' bytes, put by the owner that converted it)."""

    plan: StreamPlan
    refs: list[Any]

    def open(self) -> dict[str, Any]:
        """Every bucket fetched (zero-copy from this node's shared memory) and assembled."""
        import warnings

        import ray
        import torch

        from trainctl.workers.sampler.buckets import Assembler

        assembler = Assembler(self.plan)
        for index, ref in enumerate(self.refs):
            arrays = ray.get(ref)
            with warnings.catch_warnings():  # shared memory is read-only; it is only read
                warnings.simplefilter("ignore", UserWarning)
                assembler.fill(index, [torch.from_numpy(a) for a in arrays])
            del arrays
        return assembler.tensors()


class ObjectStoreTransport(FetchedTransport):
    """Every owner puts its buckets in Ray's object store; every engine reads and assembles
    them. An adapter's factors, a few MB, are gathered on rank 0 and put as one object. Owns
    nothing but its bucket size."""

    name: ClassVar[str] = "object_store"

    def __init__(self, bucket_bytes: int = 256 * 2**20) -> None:
        self.bucket_bytes = bucket_bytes

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        if adapter is not None:
            ref, nbytes = await source.adapter_to_object_store(adapter)
            return Shipment(self.name, version, adapter, nbytes, ref)
        plan = await source.stream_plan(self.bucket_bytes)
        refs = await source.to_object_store(plan)
        return Shipment(self.name, version, None, plan.nbytes, Streamed(plan, refs))

    def open(self, shipment: Shipment) -> Any:
        if isinstance(shipment.handle, Streamed):
            return shipment.handle.open()
        import ray

        return ray.get(shipment.handle)


class LocalTransport(FetchedTransport):
    """The tensors themselves as the handle: for an engine in the sending process (an engine
    driven without Ray: tests of one engine, notebooks)."""

    name: ClassVar[str] = "local"

    @staticmethod
    def ship(version: int, weights: Any, adapter: str | None = None) -> Shipment:
        tensors = weights.tensors if adapter is not None else weights
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Shipment(LocalTransport.name, version, adapter, nbytes, weights)

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        raise NotImplementedError("a local shipment is made with LocalTransport.ship")

    def open(self, shipment: Shipment) -> Any:
        return shipment.handle


class CollectiveTransport:
    """The base's weights sent over a group of the owners (or rank 0 alone) and every member
    engine, in the wire its engines' vLLM backend speaks (``wires.py``: ``gloo`` on CPU
    engines, ``collective.py``; vLLM's ``nccl`` on GPU engines,
    ``vllm_backend/nccl_sender.py``). Owns the group's generation and its members: a new
    generation forms whenever the engines ready to receive change, or a send failed."""

    name: ClassVar[str] = "collective"

    def __init__(self, bucket_bytes: int, timeout_s: float = 300.0, backend: str = "gloo") -> None:
        self.bucket_bytes = bucket_bytes
        self.wire = WIRES[backend]
        self.timeout_s = timeout_s
        """What a broadcast waits for a member that stopped (a hung receiver costs this once,
        then the sync goes on without it)."""
        self.generation = 0
        self.members: list[tuple[int, int | None]] = []
        """``(index, pid)`` of the engines of this generation (a recreated engine: another
        pid, so another generation)."""
        self.link: Link | None = None
        """The last ``send``'s link, which its ``deliver`` hands to the receivers."""

    async def connect(self, engines: Engines) -> None:
        members = await engines.members()
        if members != self.members:
            self.generation += 1
            self.members = members

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        if adapter is not None:
            raise ValueError("adapters travel through the object store, not the collective")
        plan = await source.stream_plan(self.bucket_bytes)
        rendezvous = await source.open_collective(
            plan, len(self.members), self.generation, self.timeout_s, self.wire.name,
            self.bucket_bytes,
        )  # fmt: skip
        first = self.wire.senders(plan)  # the senders are the group's first ranks
        ranks = {index: rank for rank, (index, _) in enumerate(self.members, start=first)}
        self.link = Link(rendezvous, ranks)
        return Shipment(self.name, version, None, plan.nbytes, plan)

    async def deliver(self, source: WeightSource, shipment: Shipment, receive: Receive[T]) -> T:
        """The owners' sends, started before the engines' receive and awaited after it. A
        send that failed is logged (the engines that missed it say why in the result) and
        drops the generation: the next ``connect`` forms a new group."""
        sending = asyncio.ensure_future(source.send_collective(shipment.handle))
        try:
            return await receive(self.link)
        finally:
            try:
                await sending
            except Exception as e:
                log.warning("the collective send of step %d failed: %s", shipment.version, e)
                self.members = []

    def open(self, shipment: Shipment) -> Any:
        raise RuntimeError("a collective shipment is received over its group, not opened")


TRANSPORTS: dict[str, WeightTransport] = {
    t.name: t for t in (ObjectStoreTransport(), LocalTransport())
}
"""The transports whose shipments an engine opens (``open_shipment``)."""


def open_shipment(shipment: Shipment) -> Any:
    """The weights of ``shipment``, opened by the transport that sent it."""
    return TRANSPORTS[shipment.transport].open(shipment)


def schema_of(tensors: dict[str, Any]) -> Schema:
    return {n: (tuple(t.shape), str(t.dtype)) for n, t in tensors.items()}


def schema_mismatch(got: Schema, want: Schema) -> str | None:
    """What differs between two weight sets' schemas (the first few differences), or None."""
    problems = [f"missing {n}" for n in sorted(want.keys() - got.keys())]
    problems += [f"unexpected {n}" for n in sorted(got.keys() - want.keys())]
    problems += [
        f"{n}: shape {got[n][0]} {got[n][1]}, expected {want[n][0]} {want[n][1]}"
        for n in sorted(got.keys() & want.keys())
        if got[n] != want[n]
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more
