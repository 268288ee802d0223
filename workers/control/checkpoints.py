"""Checkpoint directories: written under a temporary name, renamed into place when complete.

    <root>/step-000120/            a complete checkpoint: manifest.json + rank-NNNNN.pt
    <root>/.partial-step-000130-*  being written (or abandoned by a crash: ignored, swept)
    <root>/_owners/<owner>/final/  a name of one owner (a Tinker model, an adapter): each
                                   owner has its own names, its own "latest" and retention

A directory only gets its final name after every rank wrote its file and the manifest is on
disk, and ``rename`` is atomic: a crash mid-write never replaces or corrupts a good
checkpoint. Every file is flushed to disk (``fsync``) before the rename, and the rename
before the checkpoint is reported. ``keep`` bounds how many complete ones stay. With several
nodes the root must be shared storage (the Helm chart mounts a volume).

**Newest, not highest.** Each commit gets the next ``sequence`` number: "latest" is the
highest sequence, whatever its step. After a load of an older checkpoint the history goes on
from there, so a recovery restores the new history, never the abandoned one, and pruning
drops the oldest saves first. A manifest that cannot be read is skipped with a warning:
one bad directory breaks neither the list nor a save nor a resume; if its name is an
automatic one, pruning counts it as the oldest and removes it in its turn.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from trainctl.api import CheckpointInfo, CheckpointList, ConflictError, NotFoundError
from trainctl.workers.control.profile_store import (
    checked_name,
    fsync_dir,
    fsync_file,
    replace_dir,
    write_atomic,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PARTIAL = ".partial-"
OWNERS = "_owners"
"""The directory of the owners' names (a name never starts with '_', so it is no name)."""


def owner_dir(root: Path, owner: str | None) -> Path:
    """Where ``owner``'s names live under ``root`` (None: ``root`` itself, the service's own);
    the exports use it too."""
    return root if owner is None else root / OWNERS / checked_name("owner", owner)


def discard(d: Path) -> None:
    """Out of sight in one rename, then deleted: a crash mid-delete leaves a ``.partial-``
    directory beside it (swept at start), never a listed checkpoint or export missing
    files. One gone already is no error."""
    doomed = d.with_name(f"{_PARTIAL}gone-{d.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def partials(root: Path, prefix: str = _PARTIAL) -> list[Path]:
    """Directories under ``root``, or under any owner's, being written or left by a crash."""
    return [*root.glob(f"{prefix}*"), *root.glob(f"{OWNERS}/*/{prefix}*")]


class CheckpointStore:
    """The checkpoint directory of one owner (None: the service's own names). Owns the on-disk
    layout under ``root`` and the retention of ``keep`` complete checkpoints; the ranks write
    the shards."""

    def __init__(self, root: str | Path, keep: int = 3, owner: str | None = None) -> None:
        self.root = Path(root).resolve()
        self.keep, self.owner = keep, owner

    def scoped(self, owner: str | None) -> CheckpointStore:
        """The names of ``owner`` (None: this store's own)."""
        if owner is None:
            return self
        return CheckpointStore(owner_dir(self.root, owner), self.keep, owner)

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``step``."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_PARTIAL}{_automatic(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def check_name(self, name: str, overwrite: bool) -> None:
        """A 409 if a checkpoint ``name`` exists and may not be replaced (before any writing)."""
        if not overwrite and (self.root / checked_name("name", name) / MANIFEST).is_file():
            raise ConflictError(
                f"a checkpoint named {name!r} exists; pass overwrite to replace it",
                details={"checkpoint_id": name},
            )

    def commit(self, tmp: Path, info: dict[str, Any], name: str | None = None) -> CheckpointInfo:
        """Write the manifest, then rename ``tmp`` to its final name (atomic): ``name``, or
        ``step-NNNNNN``. Only the unnamed ones are pruned to ``keep``."""
        files = list(tmp.iterdir())
        for f in files:
            fsync_file(f)
        newest = max((c.sequence for c in self.list().checkpoints), default=0)
        result = CheckpointInfo(
            checkpoint_id=name or _automatic(info["step"]), owner=self.owner,
            created_at=time.time(), size_bytes=sum(f.stat().st_size for f in files),
            sequence=newest + 1, **info,
        )  # fmt: skip
        write_atomic(tmp / MANIFEST, result.model_dump_json(indent=1).encode())
        final = self.root / result.checkpoint_id
        replace_dir(tmp, final)  # the same step saved again replaces it whole
        fsync_dir(self.root)
        mib = result.size_bytes / 2**20
        log.info("checkpoint %s written (%.1f MiB)", result.checkpoint_id, mib)
        self._prune()
        return result

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def list(self) -> CheckpointList:
        """Complete checkpoints, oldest save first."""
        if not self.root.is_dir():
            return CheckpointList(checkpoints=[])
        out = []
        for d in sorted(self.root.iterdir()):
            if not d.name.startswith(_PARTIAL) and (d / MANIFEST).is_file():
                info = self._read(d)
                if info is not None:
                    out.append(info)
        return CheckpointList(checkpoints=sorted(out, key=lambda c: (c.sequence, c.created_at)))

    def latest(self) -> CheckpointInfo | None:
        found = self.list().checkpoints
        return found[-1] if found else None

    def path(self, checkpoint_id: str) -> tuple[Path, CheckpointInfo]:
        d = self.root / checked_name("checkpoint_id", checkpoint_id)
        info = None
        if not checkpoint_id.startswith(_PARTIAL) and (d / MANIFEST).is_file():
            info = self._read(d)
        if info is None:
            whose = "" if self.owner is None else f" of {self.owner!r}"
            raise NotFoundError(
                f"checkpoint {checkpoint_id!r}{whose} does not exist or is unreadable",
                details={"checkpoint_id": checkpoint_id},
            )
        return d, info

    def sweep_partial(self) -> None:
        """Remove temporary directories left by a crash (every owner's)."""
        if self.root.is_dir():
            for d in partials(self.root):
                shutil.rmtree(d, ignore_errors=True)

    def _prune(self) -> None:
        found = [
            c.checkpoint_id
            for c in self.list().checkpoints
            if c.checkpoint_id == _automatic(c.step)
        ]
        listed = set(found)
        unreadable = [  # an automatic name whose manifest cannot be read: the oldest of all
            d.name for d in sorted(self.root.iterdir())
            if _AUTOMATIC.fullmatch(d.name) and d.name not in listed and d.is_dir()
        ]  # fmt: skip
        doomed = [*unreadable, *found]
        for name in doomed[: max(0, len(doomed) - self.keep)]:
            discard(self.root / name)

    def _read(self, d: Path) -> CheckpointInfo | None:
        """``d``'s manifest, or None (logged) if it cannot be read. Its owner is the directory
        it is in: a checkpoint moved into an owner's directory is that owner's."""
        try:
            info = CheckpointInfo.model_validate_json((d / MANIFEST).read_bytes())
        except (OSError, ValueError) as e:
            log.warning("skipping checkpoint %s: its manifest cannot be read (%s)", d.name, e)
            return None
        if info.checkpoint_id != d.name:
            log.warning("skipping checkpoint %s: its manifest names %s", d.name, info.checkpoint_id)
            return None
        return info.model_copy(update={"owner": self.owner})


_AUTOMATIC = re.compile(r"step-\d{6,}")


def _automatic(step: int) -> str:
    """The id of the unnamed checkpoint of ``step``."""
    return f"step-{step:06d}"
