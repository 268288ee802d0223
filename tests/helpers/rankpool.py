"""A pool of gloo ranks that lives for a whole test module.

Starting torch and megatron-core costs seconds per process, so tests start the ranks once and
send them functions: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
results by rank. Every process group has a timeout, and ``run`` waits a bounded time, so a
hang fails the test instead of freezing CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT_S = 60


def _serve(rank: int, world: int, store_file: str, inbox: Any, outbox: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    import trainctl.workers.engine  # noqa: F401  (megatron_jit's hook, before any case's imports)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",  # no port to race other processes for
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    dist.barrier()  # the default group's gloo threads start on its first collective
    baseline = _gloo_threads()
    while (item := inbox.get()) is not None:
        fn, args = item
        try:
            ok, value = True, fn(*args)
        except BaseException:
            ok, value = False, traceback.format_exc()
        try:
            _release_case_groups()
        except BaseException:
            ok, value = False, "after the case:\n" + traceback.format_exc()
        outbox.put((rank, ok, value, _settled(baseline)))
    # Closed: every result was taken. Skip the interpreter's teardown of torch, megatron and
    # the gloo groups (seconds per process, with the machine's other worker waiting on CPU).
    os._exit(0)


def _settled(baseline: int, wait_s: float = 2.0) -> bool:
    """Whether the gloo threads are back to ``baseline``; destroyed groups' threads take a
    moment to exit, so this waits up to ``wait_s`` for them."""
    deadline = time.monotonic() + wait_s
    while _gloo_threads() > baseline:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _gloo_threads() -> int:
    """Threads of gloo process groups in this process (each group has its own)."""
    from pathlib import Path

    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(n.startswith(("gloo_", "pt_gloo")) for n in names)


def _clear_megatron_caches() -> None:
    """Empty megatron's ``functools`` caches: some cache methods (``RotaryEmbedding.forward``),
    so they hold the module, its process group, and the group's threads."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        for obj in list(vars(module).values()):
            members = vars(obj).values() if isinstance(obj, type) else [obj]
            for m in members:
                if callable(getattr(m, "cache_clear", None)):
                    m.cache_clear()


def _release_case_groups() -> None:
    """Destroy what a case created, on every rank at the same point: megatron's parallel state
    and every process group but the default one. Each gloo group keeps its own threads (and
    polls while idle); kept across cases they pile up by the hundred per worker."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.barrier()  # every rank has finished the case's collectives
    # An engine shard under ZeRO sits in a cycle the collector cannot break (EngineShard.close).
    for obj in gc.get_objects():
        if type(obj).__name__ == "EngineShard":
            obj.close()
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:  # the ops-only cases need no megatron
        pass
    else:
        mpu.destroy_model_parallel()
        # megatron-core 0.16.1's destroy misses a few globals (the intra-partial DP x CP
        # groups); a group left in one keeps its threads alive.
        for name, value in list(vars(mpu).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(mpu, name, None)
        _clear_megatron_caches()
        # The MoE aux-loss tracker keeps each loss's reduce group.
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    world = dist.group.WORLD
    for pg in list(distributed_c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    gc.collect()


class RankPool:
    """``world_size`` ranks, started once. After each case every rank destroys the groups the
    case created; if a case still left some alive (megatron's MoE layers keep their model, and
    so its groups, reachable), the ranks are replaced before the next case, so idle groups never
    pile up and poll in the background."""

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.restarts = 0
        self._store_dir = tempfile.mkdtemp(prefix="trainctl-rankpool-")
        self._starts = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        world_size = self.world_size
        self._dirty = False
        self._starts += 1
        store_file = os.path.join(self._store_dir, f"store-{self._starts}")
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, store_file, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    @property
    def dirty(self) -> bool:
        """Whether the last case left process groups alive (the next one restarts the ranks)."""
        return self._dirty

    def restart_if_dirty(self) -> None:
        """Replace the ranks if the last case left process groups alive."""
        if self._dirty:
            self._stop()
            self._start()
            self.restarts += 1

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        self.restart_if_dirty()
        for box in self._inboxes:
            box.put((fn, args))
        results: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, value, clean = self._outbox.get(timeout=1.0)
                    self._dirty |= not clean
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

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def _stop(self) -> None:
        for box in self._inboxes:
            box.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
