"""An owner's end of a sync to GPU engines built with vLLM's own ``nccl`` weight-transfer
backend: the ``nccl`` wire (``workers/sampler/wires.py``).

vLLM's ``nccl`` engine has one sender, its group's rank 0. Here that is trainer rank 0 (the
plan's first owner), which opens the group's endpoint with vLLM's ``trainer_init`` (a
``PyNcclCommunicator`` behind a store of vLLM's at this host and port), once per generation,
and broadcasts every tensor whole through vLLM's packed producer, in buffers of a bucket; the
other owners relay their buckets to it over the trainers' own group
(``workers/sampler/relay.py``). The engines receive with vLLM's
``packed_nccl_broadcast_consumer`` while this sends: the controller drives their side of
vLLM's sequence through the pool, as for ``gloo``.

Written for GPUs and tested for its control flow only (``tests/unit/test_nccl_wire.py``): the
endpoint and the broadcast are vLLM's, and no machine that runs this project's tests has a
GPU and vLLM together. vLLM's NCCL communicator turns itself off silently without CUDA, so
``open_endpoint`` refuses to run without it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.sampler.buckets import Values
from trainctl.workers.sampler.collective import Rendezvous
from trainctl.workers.sampler.relay import Relay
from trainctl.workers.sampler.stream import StreamPlan
from trainctl.workers.sampler.wires import PACKED_BUFFERS, NcclWire

Broadcast = Callable[[Any, Iterator[tuple[str, Tensor]], int], None]
"""``(communicator, tensors, buffer_bytes)``: every tensor broadcast from rank 0, packed."""


def open_endpoint(rv: Rendezvous) -> Any:
    """vLLM's communicator of the group, as its rank 0 (blocks until every engine joined)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "sampler_collective_backend: 'nccl' needs CUDA on trainer rank 0 (vLLM's NCCL "
            "communicator moves nothing without it)"
        )
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(
        {"master_address": rv.host, "master_port": rv.port, "world_size": rv.world_size}
    )


def broadcast(
    communicator: Any,
    tensors: Iterator[tuple[str, Tensor]],
    buffer: int,
    device: torch.device | None = None,
) -> None:
    """vLLM's packed broadcast of ``tensors`` from rank 0, each moved to ``device`` first
    (None: this process's GPU)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    packed_nccl_broadcast_producer(
        iterator=tensors,
        group=communicator,
        src=0,
        post_iter_func=lambda item: item[1].to(device, non_blocking=True),
        buffer_size_bytes=buffer,
        num_buffers=PACKED_BUFFERS,
    )
    if device.type == "cuda":  # the broadcasts are queued on the GPU: landed before returning
        torch.cuda.current_stream().synchronize()


class NcclSender:
    """An owner's end of the ``nccl`` wire, in its rank's actor (the same calls as
    ``collective.Sender``). Owns the trainers' group it relays over (given), on rank 0 the
    communicator of its generation, and the plan staged for the next send. A send that fails
    drops the communicator: the next sync forms a new generation."""

    def __init__(
        self,
        group: Any,
        me: int,
        endpoint: Callable[[Rendezvous], Any] = open_endpoint,
        send_all: Broadcast = broadcast,
    ) -> None:
        self.group, self.me = group, me
        self.endpoint, self.send_all = endpoint, send_all
        self.rv: Rendezvous | None = None
        self.communicator: Any = None
        self.staged: tuple[StreamPlan, Values] | None = None

    def rendezvous(
        self, host: str, world: int, generation: int, timeout_s: float, bucket_bytes: int
    ) -> Rendezvous:
        """Rank 0: where the group of ``generation`` (this sender and ``world - 1`` engine
        workers) forms: a free port of this host, where vLLM's store will listen."""
        if self.rv is None or (self.rv.generation, self.rv.world_size) != (generation, world):
            self.close()
            with socket.create_server((host, 0)) as s:
                port = s.getsockname()[1]
            self.rv = Rendezvous.new(
                host, port, world, generation, timeout_s=timeout_s, backend=NcclWire.name,
                bucket_bytes=bucket_bytes,
            )  # fmt: skip
        return self.rv

    def join(self, rv: dict[str, Any], rank: int) -> None:
        """Every other owner: it relays to rank 0 and joins no group of the engines."""
        self.rv = Rendezvous(**rv)

    def stage(self, plan: StreamPlan, owner: int, receivers: list[int], values: Values) -> None:
        """``collective.Sender.stage``'s call: ``owner`` is this rank; the receivers are the
        engines' ranks, which vLLM's broadcast reaches without naming them."""
        if owner != self.me:
            raise ValueError(f"rank {self.me} cannot send owner {owner}'s buckets")
        self.staged = (plan, values)

    def send(self, after_bucket: Callable[[int], None] | None = None) -> tuple[int, float]:
        """Relay this owner's buckets (rank 0: receive the others' and broadcast every
        tensor); the bytes this owner moved, and the seconds converting. ``after_bucket``:
        unused (a drill's stall is the gloo wire's)."""
        if self.staged is None or self.rv is None:
            raise RuntimeError("nothing staged to send")
        (plan, values), self.staged = self.staged, None
        relay = Relay(self.group, plan, self.me, values)
        if self.me != relay.relay:
            for _ in relay:  # a non-relay yields nothing: walking it sends its buckets
                pass
            return relay.nbytes, relay.convert_s
        tensors = iter(relay)
        try:
            if self.communicator is None:
                self.communicator = self.endpoint(self.rv)
            self.send_all(self.communicator, tensors, self.rv.bucket_bytes)
        except Exception:
            self.close()
            with contextlib.suppress(Exception):  # take the rest: no owner is left waiting
                for _ in tensors:
                    pass
            raise
        return relay.nbytes, relay.convert_s

    def close(self) -> None:
        if self.communicator is not None and hasattr(self.communicator, "destroy"):
            self.communicator.destroy()
        self.communicator, self.rv = None, None
