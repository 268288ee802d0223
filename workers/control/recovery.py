"""The controller's failure recovery: when the rank group is lost (a rank died, peers are
stuck, an update half applied), stop taking work, replace every rank actor and restore the
newest checkpoint that proves its content (a damaged one is passed over, never retried),
ahead of every queued operation; retried while the cluster has no room."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from trainctl.api import Info, OperationKind, RecoveryInfo
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.op_queue import Handle, OperationQueue
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.samplers import Samplers
from trainctl.workers.control.saves import Saves
from trainctl.workers.control.serving import Serving, WeightsVersion
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine.config import ConfigError

log = logging.getLogger(__name__)

RECOVERY_RETRY_S = 15.0


class Recovery:
    """Owns the rebuild of a lost rank group and its record: ``last`` (the latest recovery)
    and ``steps_lost`` (steps undone by restores, all told). It stops the service taking work
    (``serving``), queues the rebuild ahead of everything, restores the latest checkpoint
    through ``saves`` and syncs the samplers after; ``info`` is what a rebuild answers."""

    def __init__(
        self,
        *,
        serving: Serving,
        group: RankGroup,
        queue: OperationQueue,
        state: ModelState,
        adapters: Adapters,
        saves: Saves,
        samplers: Samplers,
        version: WeightsVersion,
        info: Callable[[], Awaitable[Info]],
    ) -> None:
        self.serving, self.group, self.queue, self.state = serving, group, queue, state
        self.adapters, self.saves, self.samplers = adapters, saves, samplers
        self.version, self.info = version, info
        self.last: RecoveryInfo | None = None
        self.steps_lost = 0

    @property
    def step(self) -> int:
        return self.state.step

    def begin(self, cause: str) -> None:
        """Stop taking work and queue the rebuild ahead of everything else."""
        if not self.serving.ready:
            return  # already recovering
        self.serving.ready = False
        log.error("worker group lost (%s): rebuilding", cause)
        self._queue(cause, self.step)

    def _queue(self, cause: str, step_before: int) -> None:
        if not self.serving.draining:
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
            loop.call_later(RECOVERY_RETRY_S, self._queue, cause, step_before)
            raise

    async def _rebuild(self, h: Handle, cause: str, step_before: int) -> Info:
        h.set_phase("rebuilding workers")
        self.state.window = None  # the new ranks hold no gradients
        self.group.kill(release=True)
        try:  # placed anew: a lost node's placement group cannot come back
            await self.group.place()
        except ConfigError as e:
            self.serving.waiting = f"waiting for the cluster to hold the workers again: {e}"
            raise
        self.serving.waiting = None
        self.version.bump()
        await self.group.spawn()
        restored = await self.saves.restore_latest(h)  # a damaged newest: the one before
        if restored.checkpoint_id is None:
            self.state.step = 0
            await self.adapters.reread()  # fresh ranks: no adapters
        self.last = RecoveryInfo(
            at=time.time(),
            cause=cause,
            restored_checkpoint=restored.checkpoint_id,
            step_before=step_before,
            step_after=self.step,
            skipped=restored.skipped,
        )
        self.steps_lost += step_before - self.step
        warning = await self.samplers.sync_after_load()
        if warning:
            log.warning("after recovery: %s", warning)
        self.serving.ready = True
        log.warning(
            "recovered: at step %d (was %d; %d step(s) lost)",
            self.step,
            step_before,
            step_before - self.step,
        )
        return await self.info()
