"""Memory profiles on the controller's disk: one directory per profile under a fixed root.

The ranks send their files as bytes; the store writes them (atomically), renders one PNG per
rank and a ``profile.json`` manifest, and serves them back by ``(profile_id, name)``. Ids and
names are checked against a strict pattern *and* resolved inside the root, so no request can
read or write outside it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from trainctl.api import InvalidRequestError, MemoryProfileList, MemoryProfileResult, ProfileFile
from trainctl.api.errors import NotFoundError
from trainctl.workers.control.profile_plot import memory_timeline, render_png
from trainctl.workers.engine.boundary import RankProfile

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MANIFEST = "profile.json"


def checked_name(what: str, value: str) -> str:
    """``value`` if it is a safe single path component, else a 422 naming ``what``."""
    if not _SAFE.fullmatch(value) or ".." in value:
        raise InvalidRequestError(
            f"{what}: {value[:80]!r} is not a valid {what} (letters, digits, '.', '_', '-')",
            details={"field": what},
        )
    return value


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it
    into place: a crash leaves the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, target: Path) -> None:
    """Put the complete directory ``tmp`` at ``target``: an old one is renamed aside first
    (``.partial-old-*``, swept like any partial), so ``target`` is whole at every moment but
    between two renames, and never half deleted."""
    aside = target.with_name(f".partial-old-{target.name}-{uuid.uuid4().hex[:8]}")
    if target.exists():
        os.rename(target, aside)
    os.rename(tmp, target)
    shutil.rmtree(aside, ignore_errors=True)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s bytes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ProfileStore:
    """Finished memory profiles. Owns their directory under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def path(self, profile_id: str, name: str | None = None) -> Path:
        """The path of a profile (or one of its files), guaranteed inside the root."""
        p = self.root / checked_name("profile_id", profile_id)
        if name is not None:
            p = p / checked_name("name", name)
        if not p.resolve().is_relative_to(self.root):
            raise InvalidRequestError(f"{profile_id}/{name}: outside the profile root")
        return p

    def save(self, profile_id: str, files: list[RankProfile]) -> MemoryProfileResult:
        """Store each rank's file and its picture."""
        directory = self.path(profile_id)
        directory.mkdir(parents=True, exist_ok=True)
        out = []
        for f in sorted(files, key=lambda f: f.coords.rank):
            name = checked_name("name", f.name)
            write_atomic(directory / name, f.data)
            picture = None
            try:
                ts, total = memory_timeline(name, f.data)
                coords = " ".join(f"{k}{v}" for k, v in f.coords.grid().items())
                png = render_png(f"rank {f.coords.rank} ({coords}): allocated memory", ts, total)
                picture = f"{name.split('.')[0]}.png"
                write_atomic(directory / picture, png)
            except Exception:  # a picture is a convenience: never lose the profile over it
                log.exception("could not render a picture of %s", name)
            out.append(
                ProfileFile(
                    name=name,
                    rank=f.coords.rank,
                    coords=f.coords.grid(),
                    size_bytes=len(f.data),
                    picture=picture,
                )
            )
        result = MemoryProfileResult(profile_id=profile_id, files=out)
        write_atomic(directory / MANIFEST, result.model_dump_json(indent=1).encode())
        return result

    def get(self, profile_id: str) -> MemoryProfileResult:
        manifest = self.path(profile_id) / MANIFEST
        if not manifest.is_file():
            raise NotFoundError(f"memory profile {profile_id!r} does not exist")
        return MemoryProfileResult.model_validate_json(manifest.read_bytes())

    def list(self) -> MemoryProfileList:
        if not self.root.is_dir():
            return MemoryProfileList(profiles=[])
        ids = sorted(p.name for p in self.root.iterdir() if (p / MANIFEST).is_file())
        return MemoryProfileList(profiles=[self.get(i) for i in ids])

    def read(self, profile_id: str, name: str) -> bytes:
        p = self.path(profile_id, name)
        if name == MANIFEST or not p.is_file():
            raise NotFoundError(f"memory profile {profile_id!r} has no file {name!r}")
        return p.read_bytes()
