"""The controller's checkpoints and exports: save (every rank's shard, then one commit),
load in two phases (stage everywhere, then apply: a bad shard changes nothing), and the
Hugging Face export (every rank's canonical shards merged and written on rank 0).

Checkpoints are written reshardable by default (``workers/engine/checkpoint/reshard.py``):
any layout of the same model loads them, whole or one adapter alone. Those written with
``--checkpoint-format per_rank`` (and before it existed) load only into their own layout.
Every rank file is hashed as it is written and proved before a load changes anything
(``workers/engine/checkpoint/files.py``); a start or a recovery walks back past checkpoints
that do not prove their content (``restore_latest``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from trainctl.api import (
    CheckpointFile,
    CheckpointInfo,
    CheckpointInvalidError,
    ConflictError,
    DeleteCheckpointRequest,
    Deleted,
    ExportRequest,
    ExportResult,
    InvalidRequestError,
    LoadCheckpointRequest,
    NotFoundError,
    RestoreInfo,
    SaveCheckpointRequest,
    SkippedCheckpoint,
    TrainctlError,
    WorkerError,
)
from trainctl.api.errors import field_error
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.checkpoints import CheckpointStore, discard, owner_dir, partials
from trainctl.workers.control.group import GroupLostError
from trainctl.workers.control.op_queue import Handle, Runner
from trainctl.workers.control.profile_store import replace_dir
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.save_flight import SaveFlight
from trainctl.workers.control.serving import WeightsVersion
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine.boundary import WrittenFile
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.engine.families import export_problem
from trainctl.workers.rank.export import Part
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

Commit = Callable[[list[WrittenFile]], Awaitable[CheckpointInfo]]
"""What makes the ranks' written files a checkpoint (manifest, fsync, rename)."""

PARTIAL_EXPORT = ".partial-"
"""An export being written (or left by a crash, and swept at start)."""


class Saves:
    """Owns checkpoints and exports: save (every rank's shard, then one commit), load in two
    phases, and the Hugging Face export. ``after_load`` runs after a load operation (the
    samplers follow it)."""

    def __init__(
        self,
        *,
        checkpoints: CheckpointStore,
        export_root: Path,
        group: RankGroup,
        state: ModelState,
        adapters: Adapters,
        version: WeightsVersion,
        after_load: Callable[[str | None], Awaitable[str | None]],
        reshardable: bool = True,
        precision: str | None = None,
        after_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self.checkpoints, self.export_root = checkpoints, export_root
        self.reshardable, self.precision = reshardable, precision
        self.group, self.state, self.adapters = group, state, adapters
        self.version, self.after_load = version, after_load
        self.after_commit = after_commit
        """Called once a whole-state checkpoint is committed (a shrunk layout grows back)."""
        self.flight = SaveFlight(group)
        """The save written in the background, if any (``save_in_background``)."""

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def cfg(self) -> EngineConfig:
        """The config the ranks run now: its layout goes into every checkpoint's header."""
        return self.group.cfg

    def layout(self) -> dict[str, int]:
        return dict(self.cfg.to_dict()["layout"])

    def model(self) -> dict[str, Any]:
        """The model's shape as a checkpoint records it: every field but those a load may
        change (the seed, the context length)."""
        m = json.loads(json.dumps(self.cfg.to_dict()["model"]))  # as a manifest holds it
        return {k: v for k, v in m.items() if k not in _FREE_MODEL_FIELDS}

    def fits(self, info: CheckpointInfo) -> bool:
        """Whether a whole-state checkpoint loads here: a reshardable one of this model, or a
        per-rank one of this layout."""
        if info.format == "reshardable":
            return info.model is None or _same_model(info.model, self.model())
        return info.layout == self.layout()

    def restorable(self) -> list[CheckpointInfo]:
        """The service's whole checkpoints of this model or layout, oldest save first."""
        return [
            c for c in self.checkpoints.list().checkpoints if c.adapter is None and self.fits(c)
        ]

    async def restore_latest(self, h: Handle | None = None) -> RestoreInfo:
        """Load the newest whole checkpoint that proves its content and loads here, passing
        over each newer one that does not (logged, and listed in the answer): what a start
        (``--resume latest``) and a recovery restore. A checkpoint is tried once; none
        loaded: the ranks keep the weights they started with."""
        skipped: list[SkippedCheckpoint] = []
        for c in reversed(self.restorable()):
            try:
                await self.load(c.checkpoint_id, h)
            except CheckpointInvalidError as e:
                log.warning("passing over checkpoint %s: %s", c.checkpoint_id, e.message)
                skipped.append(SkippedCheckpoint(checkpoint_id=c.checkpoint_id, reason=e.message))
                continue
            return RestoreInfo(checkpoint_id=c.checkpoint_id, skipped=skipped)
        return RestoreInfo(checkpoint_id=None, skipped=skipped)

    def save_op(self, req: SaveCheckpointRequest) -> Runner:
        store = self.checkpoints.scoped(req.owner)  # 422 now for a bad owner
        if req.adapter is not None:
            self.adapters.state(req.adapter)  # 404 now, not once queued
        if req.name is not None:
            store.check_name(req.name, req.overwrite)  # 409 now, not once queued
        return lambda h: self.save(h, req.name, req.overwrite, adapter=req.adapter, owner=req.owner)

    async def save(
        self,
        h: Handle | None = None,
        name: str | None = None,
        overwrite: bool = False,
        *,
        adapter: str | None = None,
        owner: str | None = None,
    ) -> CheckpointInfo:
        """Save the whole training state (``adapter``: that adapter alone) under ``owner``'s
        names (None: the service's own); after the save in flight, if any."""
        if h is not None:
            h.set_phase("writing checkpoint")
        written, commit, _ = await self._write(False, name, overwrite, adapter, owner)
        return await commit(written)

    async def save_in_background(self, h: Handle | None = None) -> None:
        """Save the whole training state with ``--async-save``: every rank copies its state
        (the step waits for that alone) and writes it in a thread; the checkpoint is committed
        once every file is written (``SaveFlight``). After the save in flight, if any."""
        if h is not None:
            h.set_phase("copying the state for a background save")
        step = self.step
        stalls, commit, abort = await self._write(True)
        self.flight.launch(step, max(float(s) for s in stalls), commit, abort)

    async def _write(
        self,
        background: bool,
        name: str | None = None,
        overwrite: bool = False,
        adapter: str | None = None,
        owner: str | None = None,
    ) -> tuple[list[Any], Commit, Callable[[], None]]:
        """Every rank's ``save_checkpoint`` (``background``: ``start_checkpoint``) into a
        fresh temporary directory: their answers, the commit that makes the written files a
        checkpoint, and the abort that drops them."""
        await self.flight.settle()
        store = self.checkpoints.scoped(owner)
        if name is not None:
            store.check_name(name, overwrite)  # again: one may have been saved since
        step = self.step if adapter is None else self.adapters.state(adapter).step
        tmp = store.begin(step)
        header = {"save_id": uuid.uuid4().hex, "step": step, "layout": self.layout()}
        write = RankWorker.start_checkpoint if background else RankWorker.save_checkpoint
        try:
            out = await self.group.call(write, str(tmp), adapter, self.reshardable, header)
            digests: list[str] | None = None  # in the background: hashed by the writers
            if adapter is not None:
                digests = await self.group.call(RankWorker.adapter_digest, adapter)
            elif not background:
                digests = await self.version.digests()
        except BaseException:
            store.abort(tmp)
            raise
        info = {
            "step": step, "layout": self.layout(), "adapter": adapter,
            "format": "reshardable" if self.reshardable else "per_rank",
            "precision": self.precision, "model": self.model(), "save_id": header["save_id"],
        }  # fmt: skip

        async def commit(written: list[WrittenFile]) -> CheckpointInfo:
            files = {
                f.name: CheckpointFile(size_bytes=f.size_bytes, sha256=f.sha256, moments=f.moments)
                for f in written
            }
            ours = digests if digests is not None else [f.weights_digest for f in written]
            full = {**info, "weights_digest": self.group.digest_of(ours), "files": files}
            try:
                saved = await asyncio.to_thread(store.commit, tmp, full, name)
            except BaseException:
                store.abort(tmp)
                raise
            if adapter is None:
                self.state.last_checkpoint_step = step
                self.after_commit()
            return saved

        return out, commit, lambda: store.abort(tmp)

    def load_op(self, req: LoadCheckpointRequest) -> Runner:
        _, info = self.checkpoints.scoped(req.owner).path(req.checkpoint_id)  # 404 now
        self._check_load(req.checkpoint_id, info, req.adapter, req.into)  # 422 now, not once queued

        async def run(h: Handle) -> CheckpointInfo:
            info = await self.load(
                req.checkpoint_id, h, optimizer=req.optimizer, adapter=req.adapter,
                into=req.into, owner=req.owner,
            )  # fmt: skip
            loaded = req.into or req.adapter
            warning = await self.after_load(loaded)  # the samplers follow the load
            if warning:
                log.warning("after loading %s: %s", req.checkpoint_id, warning)
            return info

        return run

    def _check_load(
        self, checkpoint_id: str, info: CheckpointInfo, adapter: str | None, into: str | None
    ) -> None:
        if info.format == "reshardable":
            saved, here = info.model, self.model()
            if saved is not None and not _same_model(saved, here):
                diff = sorted(k for k in {*saved, *here} if saved.get(k) != here.get(k))
                what = ", ".join(f"{k} {saved.get(k)} there, {here.get(k)} here" for k in diff)
                raise ConflictError(f"checkpoint {checkpoint_id} is of another model: {what}")
        elif info.layout != self.layout():
            raise ConflictError(
                f"checkpoint {checkpoint_id} was saved with layout {info.layout} in the per-rank "
                f"format, which loads into its own layout only; this service runs "
                f"{self.layout()} (start a service of that layout to load it, and save again: "
                "new saves are reshardable)"
            )
        if info.adapter is not None and adapter != info.adapter:
            raise field_error(
                "adapter",
                f"checkpoint {checkpoint_id!r} holds adapter {info.adapter!r} alone; load it "
                f"with adapter={info.adapter!r}",
            )
        if adapter is not None:
            self.adapters.check_room(into or adapter)

    async def load(
        self,
        checkpoint_id: str,
        h: Handle | None = None,
        *,
        optimizer: bool = True,
        adapter: str | None = None,
        into: str | None = None,
        owner: str | None = None,
    ) -> CheckpointInfo:
        """Load ``owner``'s checkpoint: the whole state, or (``adapter``) that adapter alone,
        as ``into`` (default: its own name), leaving the base and every other adapter as they
        are."""
        await self.flight.settle()  # its commit may prune, or be the checkpoint asked for
        path, info = self.checkpoints.scoped(owner).path(checkpoint_id)
        self._check_load(checkpoint_id, info, adapter, into)
        if h is not None:
            h.set_phase(f"loading {checkpoint_id}")
        # Phase 1 changes nothing on any rank: if a shard is missing, corrupt or does not fit,
        # the load fails and every rank keeps the weights it had.
        try:
            await self.group.call(
                RankWorker.stage_checkpoint, str(path), info, adapter, into, optimizer
            )
        except TrainctlError:
            await self.group.call_quietly(RankWorker.drop_staged)
            raise
        if adapter is None:
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
        if adapter is not None:
            await self.adapters.reread(only=into or adapter)  # the others keep their steps
            return info
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
        root = owner_dir(self.export_root, req.owner)  # 422 now for a bad owner
        if req.name is not None:
            self._check_export_name(root, req.name, req.overwrite)  # 409 now, not once queued
        return lambda h: self._write_export(req, h)

    def delete_op(self, req: DeleteCheckpointRequest) -> Runner:
        """Delete one owner's checkpoint or export in the queue's turn (a 404 now if it does
        not exist, and again in its turn if another delete took it first)."""
        self._deletable(req)

        async def run(h: Handle) -> Deleted:
            await self.flight.settle()
            path, size = self._deletable(req)
            await asyncio.to_thread(discard, path)
            what = "export" if req.export else "checkpoint"
            log.info("%s %s of %s deleted (%d bytes)", what, req.checkpoint_id,
                     req.owner or "the service", size)  # fmt: skip
            return Deleted(checkpoint_id=req.checkpoint_id, owner=req.owner, export=req.export,
                           size_bytes=size)  # fmt: skip

        return run

    def _deletable(self, req: DeleteCheckpointRequest) -> tuple[Path, int]:
        """The directory ``req`` names and its size; a 404 if there is none."""
        if not req.export:
            path, info = self.checkpoints.scoped(req.owner).path(req.checkpoint_id)
            return path, info.size_bytes
        path = owner_dir(self.export_root, req.owner) / req.checkpoint_id
        if not path.is_dir() or req.checkpoint_id.startswith(PARTIAL_EXPORT):
            whose = "" if req.owner is None else f" of {req.owner!r}"
            raise NotFoundError(
                f"export {req.checkpoint_id!r}{whose} does not exist",
                details={"checkpoint_id": req.checkpoint_id},
            )
        return path, sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    def export_partials(self) -> list[Path]:
        """Exports being written, or left by a crash (every owner's)."""
        return partials(self.export_root, PARTIAL_EXPORT)

    @staticmethod
    def _check_export_name(root: Path, name: str, overwrite: bool) -> None:
        if not overwrite and (root / name).exists():
            raise ConflictError(
                f"an export named {name!r} exists; pass overwrite to replace it",
                details={"name": name},
            )

    async def _write_export(self, req: ExportRequest, h: Handle) -> ExportResult:
        await self.flight.settle()  # the ranks' write threads would compete with the export
        step = self.step if req.adapter is None else self.adapters.state(req.adapter).step
        prefix = (
            "" if req.adapter is None else f"{req.adapter}-{'merged' if req.merged else 'peft'}-"
        )
        name = req.name or f"{prefix}step-{step:06d}"
        root = owner_dir(self.export_root, req.owner)
        self._check_export_name(root, name, req.overwrite or req.name is None)
        root.mkdir(parents=True, exist_ok=True)
        target = root / name
        tmp = root / f"{PARTIAL_EXPORT}{name}-{os.getpid()}"
        h.set_phase("gathering weights")
        part: Part = "base" if req.adapter is None else "merged" if req.merged else "adapter"
        written = self.group.gather_on_rank0(
            part, req.adapter, RankWorker.write_hf, str(tmp), req.adapter, req.merged
        )
        h.set_phase("writing safetensors")
        try:
            files = await self.group.fetch(written, "the export")
            await asyncio.to_thread(replace_dir, tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ExportResult(
            name=name,
            owner=req.owner,
            step=step,
            path=str(target.relative_to(self.export_root.parent)),
            files={f.name: f.size_bytes for f in files},
        )


_FREE_MODEL_FIELDS = frozenset({"seed", "max_seq_len"})
"""Model fields that change no parameter: a checkpoint loads across them."""


def _same_model(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    return {k: v for k, v in saved.items() if k not in _FREE_MODEL_FIELDS} == here
