"""The controller's failure recovery: when the rank group is lost (a rank died, peers are
stuck, an update half applied), stop taking work, copy the training state the surviving
ranks hold (``peers.py``), replace every rank actor and restore that copy: no step lost.
Where the survivors cannot stand in (ZeRO-1 without replicas, a model-parallel coordinate
lost with all its replicas, survivors at different steps), restore the newest checkpoint
that proves its content instead (a damaged one is passed over, never retried). Ahead of
every queued operation; retried while the cluster has no room, or with ``--on-node-loss
shrink`` placed at once on the most DP replicas the live nodes hold, and grown back to the
configured layout, the same way, after the first checkpoint once they hold it again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from trainctl.api import Info, OperationKind, RecoveryInfo, TrainctlError
from trainctl.workers.control import peers
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.op_queue import Handle, OperationQueue
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.samplers import Samplers
from trainctl.workers.control.saves import Saves
from trainctl.workers.control.serving import Serving, WeightsVersion
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine.config import ConfigError
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

RECOVERY_RETRY_S = 15.0


class Recovery:
    """Owns the rebuild of a lost rank group (and, under ``shrink``, the grow back to the
    configured layout) and its record: ``last`` (the latest recovery) and ``steps_lost``
    (steps undone by restores, all told). It stops the service taking work (``serving``),
    queues the rebuild ahead of everything, restores the survivors' copy or the latest
    checkpoint through ``saves`` and syncs the samplers after; ``info`` is what a rebuild
    answers."""

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
        from_peers: bool = True,
        shrink: bool = False,
    ) -> None:
        self.serving, self.group, self.queue, self.state = serving, group, queue, state
        self.adapters, self.saves, self.samplers = adapters, saves, samplers
        self.version, self.info = version, info
        self.from_peers = from_peers
        """Try the survivors' state before a checkpoint (``--peer-recovery``)."""
        self.shrink = shrink
        """Come back on fewer DP replicas when the live nodes cannot hold the configured
        layout, and grow back after the first checkpoint once they can (``--on-node-loss
        shrink``); else wait for the nodes."""
        self._growing = False
        """A grow is queued (``grow_soon``)."""
        self.last: RecoveryInfo | None = None
        self.steps_lost = 0
        self._copy: peers.PeerCopy | None = None
        """The survivors' copy of a rebuild not yet done, kept across its retries (the
        survivors are gone by then: the cluster had no room for their replacements)."""

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
        """The queued rebuild: replace every rank actor and restore the state; what ``info``
        says after."""
        await self._retried(h, cause, step_before)
        return await self.info()

    async def now(self, h: Handle, cause: str) -> RecoveryInfo:
        """Rebuild the group at once, inside the running operation (an update failed half
        way: whether the step stands depends on what the survivors hold); the record of it.
        If the rebuild fails, the usual retried recovery is queued and this raises."""
        step_before = self.step
        self.serving.ready = False
        log.error("worker group lost (%s): rebuilding", cause)
        return await self._retried(h, cause, step_before)

    def grow_soon(self) -> None:
        """After a whole checkpoint is committed: if the ranks run fewer DP replicas than
        configured and the live nodes hold the configured layout again, queue the rebuild
        that grows back, ahead of everything (``_grow``)."""
        if self._growing or not self.group.shrunk or not self.serving.taking_work:
            return
        if self.group.holds_configured():
            self._growing = True
            self.queue.submit(OperationKind.RECOVER, self._grow, front=True)

    async def _grow(self, h: Handle) -> Info:
        """Back to the configured layout, from the live ranks' state (the checkpoint just
        committed holds the same step, so a fallback to it loses nothing). Never inside a
        ``forward_backward`` window, nor when a step was applied after the checkpoint and it
        must fall back (then the next checkpoint tries again)."""
        self._growing = False
        await self.saves.flight.settle()  # a background save: committed first
        windows = self.state.window is not None or self.adapters.open_windows()
        not_now = (
            "a forward_backward window is open" if windows
            else f"step {self.step} came after the checkpoint"
            if self.step != self.state.last_checkpoint_step
            else "the live nodes no longer hold the configured layout"
            if not self.group.holds_configured()
            else None
        )  # fmt: skip
        if not self.group.shrunk or not_now:
            if not_now:
                log.info("not growing back now (%s): the next checkpoint tries again", not_now)
            return await self.info()
        cause = f"growing back to the configured layout ({self.group.configured.layout.describe()})"
        self.serving.ready = False
        log.warning("%s: rebuilding", cause)
        await self._retried(h, cause, self.step, failure=False)
        return await self.info()

    async def _retried(
        self, h: Handle, cause: str, step_before: int, *, failure: bool = True
    ) -> RecoveryInfo:
        """``_replace``; if it fails (e.g. the cluster has no room yet for a replacement),
        queued again in ``RECOVERY_RETRY_S`` (as a failure's recovery: the ranks are gone).
        ``failure``: the record becomes ``last`` (a grow's does not)."""
        try:
            got = await self._replace(h, cause, step_before)
        except Exception:
            log.exception("recovery failed; trying again in %.0fs", RECOVERY_RETRY_S)
            loop = asyncio.get_running_loop()
            loop.call_later(RECOVERY_RETRY_S, self._queue, cause, step_before)
            raise
        if failure:
            self.last = got
        self.steps_lost += got.steps_lost
        return got

    async def _replace(self, h: Handle, cause: str, step_before: int) -> RecoveryInfo:
        """Copy the survivors' state, replace every rank, restore the copy (or the newest
        checkpoint that loads), sync the samplers; serve again."""
        self.state.window = None  # no rank keeps gradients
        await self.saves.flight.settle()  # committed if every file was written, else dropped
        copy: peers.PeerCopy | peers.NoPeerCopy = peers.NoPeerCopy("recovery from peers is off")
        if self._copy is not None:  # a retry: the copy taken before the first try
            copy = self._copy
        elif self.from_peers:
            h.set_phase("copying the survivors' state")
            copy = await peers.copy_from_survivors(
                self.group,
                zero=self.group.cfg.use_distributed_optimizer,
                timeout_s=self.group.cfg.collective_timeout_s,
            )
            self._copy = copy if isinstance(copy, peers.PeerCopy) else None
        h.set_phase("rebuilding workers")
        self.group.kill(release=True)
        try:  # placed anew: a lost node's placement group cannot come back
            await self.group.place(shrink=self.shrink)
        except ConfigError as e:
            self.serving.waiting = f"waiting for the cluster to hold the workers again: {e}"
            raise
        self.serving.waiting = None
        self.version.bump()
        await self.group.spawn()
        if isinstance(copy, peers.PeerCopy):
            self._copy = None  # tried once: restored, or the checkpoint's turn
            try:
                await self._restore_copy(h, copy)
            except TrainctlError as e:
                log.error("the survivors' copy did not load (%s): restoring a checkpoint", e)
                copy = peers.NoPeerCopy(f"the survivors' copy did not load: {e.message}")
        if isinstance(copy, peers.PeerCopy):
            record = RecoveryInfo(
                at=time.time(), cause=cause, source="peer", restored_checkpoint=None,
                step_before=step_before, step_after=self.step, layout=self.saves.layout(),
            )  # fmt: skip
        else:
            if self.from_peers:
                log.warning("not from the survivors: %s", copy.reason)
            restored = await self.saves.restore_latest(h)  # a damaged newest: the one before
            if restored.checkpoint_id is None:
                self.state.step = 0
                await self.adapters.reread()  # fresh ranks: no adapters
            record = RecoveryInfo(
                at=time.time(), cause=cause,
                source="checkpoint" if restored.checkpoint_id else "start",
                peer_fallback=copy.reason if self.from_peers else None,
                restored_checkpoint=restored.checkpoint_id, step_before=step_before,
                step_after=self.step, skipped=restored.skipped, layout=self.saves.layout(),
            )  # fmt: skip
        warning = await self.samplers.sync_after_load()
        if warning:
            log.warning("after recovery: %s", warning)
        self.serving.ready = True
        log.warning(
            "recovered from %s on %s: at step %d (was %d; %d step(s) lost)",
            record.source,
            self.group.cfg.layout.describe(),
            self.step,
            step_before,
            record.steps_lost,
        )
        return record

    async def _restore_copy(self, h: Handle, copy: peers.PeerCopy) -> None:
        """The new ranks cut their shards out of the survivors' copies (phase 1 changes
        nothing), then apply them; the copies are dropped after."""
        h.set_phase(f"restoring step {copy.step} from surviving rank(s) {copy.ranks}")
        try:
            await self.group.call(RankWorker.stage_peers, *copy.states)
        except TrainctlError:
            await self.group.call_quietly(RankWorker.drop_staged)
            raise
        await self.group.call(RankWorker.apply_checkpoint, True)
        self.state.step = copy.step
        await self.adapters.reread()  # the survivors' adapters, at their steps
