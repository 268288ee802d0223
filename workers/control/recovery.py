"""The controller's failure recovery: when the rank group is lost (a rank died, peers are
stuck, an update half applied), stop taking work, replace every rank actor and restore the
latest checkpoint, ahead of every queued operation; retried while the cluster has no room."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from trainctl.api import CheckpointInfo, Info, OperationKind, RecoveryInfo
from trainctl.workers.control.op_queue import Handle, OperationQueue
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine.config import ConfigError

if TYPE_CHECKING:
    from trainctl.workers.control.adapters import Adapters

log = logging.getLogger(__name__)

RECOVERY_RETRY_S = 15.0


class RecoveryPart:
    """Mixed into ``Controller``: what it needs of the controller is declared here."""

    ready: bool
    draining: bool
    waiting: str | None
    recovery: RecoveryInfo | None
    steps_lost: int
    group: RankGroup
    adapters: Adapters
    state: ModelState
    queue: OperationQueue
    _weights_epoch: int

    if TYPE_CHECKING:

        @property
        def step(self) -> int: ...

        def _latest_checkpoint(self) -> CheckpointInfo | None: ...

        async def _load(
            self, checkpoint_id: str, h: Handle | None = None, *, optimizer: bool = True
        ) -> CheckpointInfo: ...

        async def info(self) -> Info: ...

        async def _sync_after_load(self) -> str | None: ...

    def _begin_recovery(self, cause: str) -> None:
        """Stop taking work and queue the rebuild ahead of everything else."""
        if not self.ready:
            return  # already recovering
        self.ready = False
        log.error("worker group lost (%s): rebuilding", cause)
        self._queue_recovery(cause, self.step)

    def _queue_recovery(self, cause: str, step_before: int) -> None:
        if not self.draining:
            run = lambda h: self._recover(h, cause, step_before)  # noqa: E731
            self.queue.submit(OperationKind.RECOVER, run, front=True)

    async def _recover(self, h: Handle, cause: str, step_before: int) -> Info:
        """Replace every rank actor and restore the latest checkpoint; retried while it fails
        (e.g. the cluster has no room yet for a replacement)."""
        try:
            return await self._rebuild(h, cause, step_before)
        except Exception:
            log.exception("recovery failed; trying again in %.0fs", RECOVERY_RETRY_S)
            loop = asyncio.get_running_loop()
            loop.call_later(RECOVERY_RETRY_S, self._queue_recovery, cause, step_before)
            raise

    async def _rebuild(self, h: Handle, cause: str, step_before: int) -> Info:
        h.set_phase("rebuilding workers")
        self.state.window = None  # the new ranks hold no gradients
        self.group.kill(release=True)
        try:  # placed anew: a lost node's placement group cannot come back
            await self.group.place()
        except ConfigError as e:
            self.waiting = f"waiting for the cluster to hold the workers again: {e}"
            raise
        self.waiting = None
        self._weights_epoch += 1
        await self.group.spawn()
        latest = self._latest_checkpoint()
        if latest is not None:
            h.set_phase(f"restoring {latest.checkpoint_id}")
            await self._load(latest.checkpoint_id)
        else:
            self.state.step = 0
            await self.adapters.reread()  # fresh ranks: no adapters
        self.recovery = RecoveryInfo(
            at=time.time(),
            cause=cause,
            restored_checkpoint=latest.checkpoint_id if latest else None,
            step_before=step_before,
            step_after=self.step,
        )
        self.steps_lost += step_before - self.step
        warning = await self._sync_after_load()
        if warning:
            log.warning("after recovery: %s", warning)
        self.ready = True
        log.warning(
            "recovered: at step %d (was %d; %d step(s) lost)",
            self.step,
            step_before,
            step_before - self.step,
        )
        return await self.info()
