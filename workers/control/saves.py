"""The controller's checkpoints and exports: save (every rank's shard, then one commit),
load in two phases (stage everywhere, then apply: a bad shard changes nothing), and the
Hugging Face export (every rank's canonical shards merged and written on rank 0)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from trainctl.api import (
    CheckpointInfo,
    ConflictError,
    ExportRequest,
    ExportResult,
    InvalidRequestError,
    LoadCheckpointRequest,
    SaveCheckpointRequest,
    TrainctlError,
    WorkerError,
)
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.checkpoints import CheckpointStore
from trainctl.workers.control.group import GroupLostError
from trainctl.workers.control.op_queue import Handle, Runner
from trainctl.workers.control.profile_store import replace_dir
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.serving import WeightsVersion
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.engine.families import export_problem
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

PARTIAL_EXPORT = ".partial-"
"""An export being written (or left by a crash, and swept at start)."""


class Saves:
    """Owns checkpoints and exports: save (every rank's shard, then one commit), load in two
    phases, and the Hugging Face export. ``after_load`` runs after a load operation (the
    samplers follow it)."""

    def __init__(
        self,
        *,
        cfg: EngineConfig,
        checkpoints: CheckpointStore,
        export_root: Path,
        group: RankGroup,
        state: ModelState,
        adapters: Adapters,
        version: WeightsVersion,
        after_load: Callable[[], Awaitable[str | None]],
    ) -> None:
        self.cfg, self.checkpoints, self.export_root = cfg, checkpoints, export_root
        self.group, self.state, self.adapters = group, state, adapters
        self.version, self.after_load = version, after_load

    @property
    def step(self) -> int:
        return self.state.step

    def layout(self) -> dict[str, int]:
        return dict(self.cfg.to_dict()["layout"])

    def latest(self) -> CheckpointInfo | None:
        found = [c for c in self.checkpoints.list().checkpoints if c.layout == self.layout()]
        return found[-1] if found else None

    def save_op(self, req: SaveCheckpointRequest) -> Runner:
        if req.name is not None:
            self.checkpoints.check_name(req.name, req.overwrite)  # 409 now, not once queued
        return lambda h: self.save(h, req.name, req.overwrite)

    async def save(
        self, h: Handle | None = None, name: str | None = None, overwrite: bool = False
    ) -> CheckpointInfo:
        if h is not None:
            h.set_phase("writing checkpoint")
        if name is not None:
            self.checkpoints.check_name(name, overwrite)  # again: one may have been saved since
        tmp = self.checkpoints.begin(self.step)
        try:
            await self.group.call(RankWorker.save_checkpoint, str(tmp))
            digest = self.group.digest_of(await self.version.digests())
            info = {"step": self.step, "layout": self.layout(), "weights_digest": digest}
            saved = await asyncio.to_thread(self.checkpoints.commit, tmp, info, name)
        except BaseException:
            self.checkpoints.abort(tmp)
            raise
        self.state.last_checkpoint_step = self.step
        return saved

    def load_op(self, req: LoadCheckpointRequest) -> Runner:
        self.checkpoints.path(req.checkpoint_id)  # 404 now, not once queued

        async def run(h: Handle) -> CheckpointInfo:
            info = await self.load(req.checkpoint_id, h, optimizer=req.optimizer)
            warning = await self.after_load()  # the samplers follow the load
            if warning:
                log.warning("after loading %s: %s", req.checkpoint_id, warning)
            return info

        return run

    async def load(
        self, checkpoint_id: str, h: Handle | None = None, *, optimizer: bool = True
    ) -> CheckpointInfo:
        path, info = self.checkpoints.path(checkpoint_id)
        if info.layout != self.layout():
            raise ConflictError(
                f"checkpoint {checkpoint_id} was saved with layout {info.layout}; this service "
                f"runs {self.layout()}"
            )
        if h is not None:
            h.set_phase(f"loading {checkpoint_id}")
        # Phase 1 changes nothing on any rank: if a shard is missing, corrupt or does not fit,
        # the load fails and every rank keeps the weights it had.
        try:
            await self.group.call(RankWorker.stage_checkpoint, str(path))
        except TrainctlError:
            await self.group.call_quietly(RankWorker.drop_staged)
            raise
        self.version.bump()
        try:  # phase 2: local on every rank; a failure here leaves the replicas different
            await self.group.call(RankWorker.apply_checkpoint, optimizer)
        except WorkerError as e:
            cause = f"{e.message} (applying {checkpoint_id})"
            raise GroupLostError(
                f"{cause}; the ranks may now hold different weights, so they are being "
                "restored from the latest checkpoint: retry shortly",
                details=e.details,
                cause=cause,
            ) from None
        self.state.window = None  # a load drops the gradients waiting for optim_step
        self.state.step = info.step
        self.state.last_checkpoint_step = info.step
        await self.adapters.reread()  # the checkpoint's adapters, at their steps
        return info

    def export_op(self, req: ExportRequest) -> Runner:
        m = self.cfg.model
        problem = export_problem(m.family, m.num_experts)
        if problem:
            raise InvalidRequestError(f"export: {problem}")
        if req.adapter is not None:
            self.adapters.state(req.adapter)  # 404 now, not once queued
        if req.name is not None:
            self._check_export_name(req.name, req.overwrite)  # 409 now, not once queued
        return lambda h: self._write_export(req, h)

    def _check_export_name(self, name: str, overwrite: bool) -> None:
        if not overwrite and (self.export_root / name).exists():
            raise ConflictError(
                f"an export named {name!r} exists; pass overwrite to replace it",
                details={"name": name},
            )

    async def _write_export(self, req: ExportRequest, h: Handle) -> ExportResult:
        step = self.step if req.adapter is None else self.adapters.state(req.adapter).step
        prefix = (
            "" if req.adapter is None else f"{req.adapter}-{'merged' if req.merged else 'peft'}-"
        )
        name = req.name or f"{prefix}step-{step:06d}"
        self._check_export_name(name, req.overwrite or req.name is None)
        target = self.export_root / name
        tmp = self.export_root / f"{PARTIAL_EXPORT}{name}-{os.getpid()}"
        h.set_phase("gathering weights")
        part = "base" if req.adapter is None else "merged" if req.merged else "adapter"
        written = self.group.gather_on_rank0(
            RankWorker.canonical_shards, (part, req.adapter), RankWorker.write_hf,
            (str(tmp), req.adapter, req.merged),
        )  # fmt: skip
        h.set_phase("writing safetensors")
        try:
            files = await self.group.fetch(written, "the export")
            await asyncio.to_thread(replace_dir, tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ExportResult(
            name=name,
            step=step,
            path=str(target),
            files={f.name: f.size_bytes for f in files},
        )
