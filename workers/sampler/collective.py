"""Weights over a collective: a gloo group between one sender (the trainer side) and the
sampler engines' model workers, and a version's tensors broadcast through it in buckets.

The plan is known to every member before a byte moves: the sender makes it from the
version's schema (``plan``), hands it to every receiver with the sync's one call, and both
sides walk it in the same order. Each bucket is one flat byte buffer and one broadcast, never
one call per tensor. A receiver keeps every bucket until the last has arrived, and only then
does anything with them (``receive`` returns the whole set or raises): a send that breaks
half-way leaves the weights it serves untouched.

A group lives for one generation: it is formed when the engines start (or one is
recreated), behind a store key prefixed with a secret (``Rendezvous.prefix``), as the ranks'
own rendezvous is. A new generation is a new group; members of an old one are never mixed in.

Torch only: this module imports nothing from vLLM, so the sending side needs no vLLM.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainctl.workers.sampler.transport import Schema


@dataclass(frozen=True)
class Rendezvous:
    """Where a group forms: the sender's store, a secret key prefix, the member count and
    the generation. Plain values: it travels to every member as a dict."""

    host: str
    port: int
    prefix: str
    world_size: int
    """The sender (rank 0) and every receiver."""
    generation: int
    timeout_s: float = 120.0

    @staticmethod
    def new(host: str, port: int, receivers: int, generation: int, **kw: Any) -> Rendezvous:
        return Rendezvous(host, port, secrets.token_hex(16), receivers + 1, generation, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """A collective shipment's handle (``Shipment.handle``): what will be broadcast, in which
    buckets. The tensors themselves are nowhere but on the sender until the broadcast."""

    schema: Schema
    buckets: list[list[str]]

    @staticmethod
    def of(schema: Schema, bucket_bytes: int) -> Plan:
        return Plan(schema, plan(schema, bucket_bytes))


def open_group(rv: Rendezvous, rank: int, listener: Any = None) -> Any:
    """This member's gloo group (rank 0: the sender, whose process hosts the store, on
    ``listener`` where given: a socket bound to the node's address alone). Blocks until every
    member has joined, at most ``rv.timeout_s``."""
    timeout = timedelta(seconds=rv.timeout_s)
    listen = {"master_listen_fd": listener.fileno()} if rank == 0 and listener else {}
    store = dist.TCPStore(
        rv.host, rv.port, world_size=rv.world_size, is_master=rank == 0, timeout=timeout,
        wait_for_workers=False, **listen,
    )  # fmt: skip
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
    return group


def plan(schema: Schema, bucket_bytes: int) -> list[list[str]]:
    """The schema's names in buckets of at most ``bucket_bytes`` each, in name order (every
    member computes the same from the same schema). A tensor larger than a bucket is
    refused: a bucket holds whole tensors."""
    out: list[list[str]] = [[]]
    filled = 0
    for name in sorted(schema):
        size = nbytes(schema[name])
        if size > bucket_bytes:
            raise ValueError(
                f"sampler_bucket_mb: {name} is {size / 2**20:.1f} MiB, more than one bucket "
                f"({bucket_bytes / 2**20:.1f} MiB); raise the bucket size"
            )
        if filled + size > bucket_bytes and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(name)
        filled += size
    return [b for b in out if b]


def nbytes(entry: tuple[tuple[int, ...], str]) -> int:
    shape, dtype = entry
    return _dtype(dtype).itemsize * int(torch.Size(shape).numel())


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def send(
    group: Any,
    tensors: dict[str, Tensor],
    buckets: list[list[str]],
    after_bucket: Callable[[int], None] | None = None,
) -> int:
    """Broadcast ``tensors`` (rank 0's side) bucket by bucket; returns the bytes sent.
    ``after_bucket(i)`` runs once bucket ``i`` went out (a drill's stall)."""
    sent = 0
    for i, names in enumerate(buckets):
        flat = torch.cat(
            [tensors[n].detach().contiguous().view(-1).view(torch.uint8) for n in names]
        )
        group.broadcast(flat, 0).wait()
        sent += flat.numel()
        if after_bucket is not None:
            after_bucket(i)
    return sent


def receive(group: Any, schema: Schema, buckets: list[list[str]]) -> dict[str, Tensor]:
    """A receiver's side of ``send``: every bucket into its own buffer, then the tensors as
    views of them. Returns only once all have arrived (a failed broadcast raises)."""
    out: dict[str, Tensor] = {}
    for names in buckets:
        sizes = [nbytes(schema[n]) for n in names]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast(flat, 0).wait()
        for name, part in zip(names, torch.split(flat, sizes), strict=True):
            shape, dtype = schema[name]
            out[name] = part.view(_dtype(dtype)).view(shape)
    return out


class Sender:
    """The sending end of the collective, in the process that holds the merged weights (rank
    0's actor). Owns the group of its generation and the one version staged for the next
    send. A send that fails drops the group: the next sync forms a new generation."""

    def __init__(self) -> None:
        self.rv: Rendezvous | None = None
        self.listener: Any = None
        """The socket the store listens on: the node's address only, never every interface
        (torch's own store would take every one); keys are under the secret prefix too."""
        self.group: Any = None
        self.staged: tuple[dict[str, Tensor], Plan] | None = None

    def rendezvous(
        self, host: str, receivers: int, generation: int, timeout_s: float
    ) -> Rendezvous:
        """Where the group of ``generation`` forms (a new store for a new generation); each
        of its broadcasts waits for a member at most ``timeout_s``."""
        if self.rv is None or self.rv.generation != generation:
            import socket

            self.close()
            self.listener = socket.create_server((host, 0), backlog=128)
            port = int(self.listener.getsockname()[1])
            self.rv = Rendezvous.new(host, port, receivers, generation, timeout_s=timeout_s)
        return self.rv

    def close(self) -> None:
        self.group, self.rv = None, None
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def stage(self, tensors: dict[str, Tensor], version_plan: Plan) -> None:
        self.staged = (tensors, version_plan)

    def send(self, after_bucket: Callable[[int], None] | None = None) -> int:
        """Broadcast the staged version to the group (formed first if new); the bytes sent."""
        if self.staged is None or self.rv is None:
            raise RuntimeError("nothing staged to send")
        (tensors, version_plan), self.staged = self.staged, None
        try:
            if self.group is None:
                self.group = open_group(self.rv, 0, self.listener)
                # The store serves on the listener's descriptor from now on, and closes it
                # with itself: this socket object must not close it again.
                self.listener.detach()
                self.listener = None
            return send(self.group, tensors, version_plan.buckets, after_bucket)
        except Exception:
            self.close()
            raise
