"""The memory-profile operations: every rank records its allocations between a start and a
stop; the stop stores one file and one picture per rank (``profile_store.py``)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from trainctl.api import (
    ConflictError,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    NoArguments,
)
from trainctl.workers.control.op_queue import Runner
from trainctl.workers.control.profile_store import ProfileStore
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.steps import ModelState
from trainctl.workers.rank.worker import RankWorker


class ProfileRecorder:
    """A memory-profile operation in progress. Owns the id of the profile being recorded; the
    ranks record, the ``ProfileStore`` keeps the results."""

    def __init__(self, group: RankGroup, store: ProfileStore, state: ModelState) -> None:
        self.group, self.store, self.state = group, store, state
        self.profile_id: str | None = None
        """The profile recording now, if any."""

    def start(self, req: MemoryProfileStartRequest) -> Runner:
        return lambda h: self._start(req.max_entries)

    def stop(self, _: NoArguments) -> Runner:
        return lambda h: self._stop()

    async def _start(self, max_entries: int) -> MemoryProfileStarted:
        if self.profile_id is not None:
            raise ConflictError(f"memory profile {self.profile_id} is already recording")
        await self.group.call(RankWorker.start_memory_profile, max_entries)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.profile_id = f"{stamp}-step{self.state.step:06d}"
        return MemoryProfileStarted(profile_id=self.profile_id, ranks=self.group.world_size)

    async def _stop(self) -> MemoryProfileResult:
        if self.profile_id is None:
            raise ConflictError("no memory profile is recording; start one first")
        pid, self.profile_id = self.profile_id, None
        files = await self.group.call(RankWorker.stop_memory_profile)
        return await asyncio.to_thread(self.store.save, pid, files)
