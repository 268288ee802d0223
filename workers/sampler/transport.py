"""How a version of the weights travels from the ranks to the sampler engines.

A ``WeightTransport`` has two ends. ``send`` runs in the controller: it has the ranks gather
one version (through a ``WeightSource``, which the control room implements with its rank
group) and puts it where every engine can reach it, returning a ``Shipment``: a small record
that names the transport and holds its handle, never the tensors. ``open`` runs where the
weights are loaded, inside the engine's model worker, and gives the tensors back.

So the tensors never travel as arguments of an engine's internal calls: a worker in another
process (vLLM's ``AsyncLLM`` runs its model workers so, and hands ``collective_rpc``
arguments over as plain lists) opens the shipment itself, from shared memory or a file.
``object_store`` is the first transport: rank 0 puts the merged tensors in Ray's object store
once, and each engine reads them from its node's shared memory (Ray copies them across nodes).
It needs the worker to be a Ray process (true of an engine core in the actor's process). A
GPU-to-GPU transport (NCCL between the ranks and the engines) plugs in beside it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

Schema = dict[str, tuple[tuple[int, ...], str]]
"""A weight set's names, each with its shape and dtype."""


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


class WeightSource(Protocol):
    """The ranks, as a transport asks them for weights (the control room implements it)."""

    async def to_object_store(self, adapter: str | None) -> tuple[Any, int]:
        """The current weights (``adapter``: its PEFT tensors), gathered on rank 0 and put in
        the object store once: the reference and the size in bytes."""
        ...


class WeightTransport(Protocol):
    name: ClassVar[str]

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        """Gather version ``version`` on the ranks and make it reachable by every engine."""
        ...

    def open(self, shipment: Shipment) -> Any:
        """In the process that loads the weights: HF-named tensors (a ``PeftAdapter`` for
        an adapter's shipment)."""
        ...


class ObjectStoreTransport:
    """Rank 0 puts the merged tensors in Ray's object store once; every engine reads them."""

    name: ClassVar[str] = "object_store"

    async def send(self, source: WeightSource, version: int, adapter: str | None) -> Shipment:
        ref, nbytes = await source.to_object_store(adapter)
        return Shipment(self.name, version, adapter, nbytes, ref)

    def open(self, shipment: Shipment) -> Any:
        import ray

        return ray.get(shipment.handle)


class LocalTransport:
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


TRANSPORTS: dict[str, WeightTransport] = {
    t.name: t for t in (ObjectStoreTransport(), LocalTransport())
}


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
