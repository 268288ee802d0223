"""This rank's way into its group's ``torch.distributed`` process group: the rendezvous store
(rank 0's, behind a gate) or a door to it (``workers/rendezvous.py``)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any


def process_group_backend(backend: str, *, cuda: bool) -> str:
    """``auto``: gloo on CPU; with CUDA, NCCL for device tensors and gloo for host ones (the
    step's bookkeeping - packing metadata, loss and metric scalars - stays on the host)."""
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


class GroupJoin:
    """One rank's membership of the process group. Owns rank 0's store and gate, or another
    rank's door to that gate, until ``close``."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store: Any = None
        self._gate: Any = None
        """Rank 0: the gate in front of the rendezvous store (``rendezvous_address``)."""
        self._door: Any = None
        """Every other rank: its way to rank 0's gate."""

    def rendezvous_address(self, timeout_s: float) -> tuple[str, int, str]:
        """Called on rank 0: start the group's rendezvous store and return where the other
        ranks reach it, and the group's secret (which travels over Ray only).

        torch's store takes ``set`` and ``delete`` from anyone who reaches it. So it listens
        on loopback alone, behind a gate on the node's cluster address (a port the OS picks:
        no race for a 'free' port) that admits a connection only once it has shown the
        secret (``workers/rendezvous.py``); the others go through a door of their own. And
        every key the group uses is under a prefix made of the secret as well
        (``init_process_group``)."""
        import secrets
        import socket

        import ray

        from trainctl.workers import rendezvous

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray
        host = node_ip()
        secret = secrets.token_hex(16)
        self._store = rendezvous.master_store(self.world_size, timeout_s)
        self._gate = rendezvous.Gate(socket.create_server((host, 0), backlog=128), secret)
        self._gate.open(int(self._store.port))
        return host, self._gate.port, secret

    def init_process_group(
        self, host: str, port: int, secret: str, backend: str, timeout_s: float
    ) -> None:
        """Join the group through rank 0's store (rank 0) or a door to its gate (the others);
        every collective of the group times out after ``timeout_s``."""
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore

        from trainctl.workers import rendezvous

        backend = process_group_backend(backend, cuda=torch.cuda.is_available())
        store = self._store
        if store is None:  # through a door to rank 0's gate
            store, self._door = rendezvous.member_store(
                host, port, secret, self.world_size, timeout_s
            )
        dist.init_process_group(
            backend=backend,
            store=PrefixStore(f"trainctl-{secret}", store),  # keys no one else can name
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def close(self) -> None:
        """Leave the process group and close the gate or the door."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for relay in (self._gate, self._door):
            if relay is not None:
                relay.close()
