"""The checkpoint save in flight in the background (``--async-save``): every rank has copied
its state and writes it in a thread (``workers/rank/background_save.py``); this asks the ranks
until every file is done, then commits the checkpoint (manifest, fsync, rename). Until then it
has a ``.partial-`` name: never listed, never pruned, never restored. A write that fails is
aborted (its directory removed), logged, and kept as ``last_error`` for ``info``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from trainctl.api import SaveInFlight, TrainctlError
from trainctl.workers.control.group import Group
from trainctl.workers.engine.boundary import WrittenFile
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the ranks are asked whether their file is written."""


@dataclass
class _Flight:
    step: int
    started_at: float
    stall_s: float
    task: asyncio.Task[None]


class SaveFlight:
    """Owns the one background save in flight (its poll-and-commit task) and the last
    background save's failure."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._flight: _Flight | None = None
        self.last_error: str | None = None
        """Why the last background save failed (None: it did not, or none ran)."""

    @property
    def busy(self) -> bool:
        return self._flight is not None and not self._flight.task.done()

    def launch(
        self,
        step: int,
        stall_s: float,
        commit: Callable[[list[WrittenFile]], Awaitable[object]],
        abort: Callable[[], None],
    ) -> None:
        """Follow the ranks' writes of ``step``'s checkpoint to its ``commit`` (``abort`` if
        a write fails). One at a time: ``settle`` the previous one first."""
        assert not self.busy, "settle the save in flight first"
        task = asyncio.get_running_loop().create_task(self._follow(step, commit, abort))
        self._flight = _Flight(step, time.time(), stall_s, task)

    async def _follow(
        self,
        step: int,
        commit: Callable[[list[WrittenFile]], Awaitable[object]],
        abort: Callable[[], None],
    ) -> None:
        try:
            while True:
                written = await self.group.call(RankWorker.checkpoint_written)
                if all(w is not None for w in written):
                    break
                await asyncio.sleep(POLL_S)
            await commit([w for w in written if w is not None])
            self.last_error = None
        except Exception as e:
            abort()
            why = e.message if isinstance(e, TrainctlError) else f"{type(e).__name__}: {e}"
            self.last_error = f"the background save of step {step} failed: {why}"
            log.error("%s", self.last_error)

    async def settle(self) -> None:
        """Wait for the save in flight, if any, to be committed or aborted (what a load, an
        export, another save, a recovery and a shutdown do first)."""
        flight = self._flight
        if flight is not None:
            await asyncio.shield(flight.task)

    def info(self) -> SaveInFlight | None:
        f = self._flight
        if f is None or f.task.done():
            return None
        return SaveInFlight(
            step=f.step, started_at=f.started_at, stall_s=f.stall_s,
            seconds=time.time() - f.started_at,
        )  # fmt: skip
