"""A pool of gloo ranks that lives for a whole test module.

Starting torch and megatron-core costs seconds per process, so tests start the ranks once and
send them functions: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
results by rank. Every process group has a timeout, and ``run`` waits a bounded time, so a
hang fails the test instead of freezing CI.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while (item := inbox.get()) is not None:
        fn, args = item
        try:
            outbox.put((rank, True, fn(*args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout_s = world_size, timeout_s
        port = _free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, port, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        for box in self._inboxes:
            box.put((fn, args))
        results: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, value = self._outbox.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead:  # e.g. gloo aborted on a collective mismatch
                        raise RuntimeError(f"rank(s) {dead} died; see their stderr") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"ranks did not answer within {self.timeout_s}s"
                        ) from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for box in self._inboxes:
            box.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
