"""A checkpoint's rank files: their names, how a rank writes one, and how a load proves one.

A checkpoint directory holds one ``rank-NNNNN.pt`` per writing rank (``torch.save`` of the
rank's state, read back with ``weights_only``) and the controller's ``manifest.json``.

**Written through a hash.** A rank streams its file through sha256 as ``torch.save`` writes
it, so hashing costs no second pass over the bytes and runs on the rank that writes them. The
file carries a header (the save's id, its step and the writer's layout); the manifest records
each file's size, digest and count of AdamW moment tensors.

**Proved before a load.** Before any rank changes state, the loading ranks split the files
among themselves (file ``i`` to rank ``i mod world``, whatever the writer's layout was) and
each proves its share: the bytes hash to the manifest's digest, the header names the
manifest's save, step and layout, every tensor is finite, and (for a load with the optimizer)
the moments the manifest counts are all there. A failure is a ``CheckpointInvalidError``
naming the file and why, so a walk back to an older checkpoint can tell damage from a bug.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import pickle
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainctl.api import CheckpointInfo, CheckpointInvalidError
from trainctl.workers.engine.boundary import WrittenFile
from trainctl.workers.engine.checkpoint.reshard import MOMENTS, Reader

HEADER = "header"
"""The key of a rank file's header: ``save_id``, ``step`` and ``layout``."""


def name(rank: int) -> str:
    """The file rank ``rank`` writes."""
    return f"rank-{rank:05d}.pt"


def rank_files(directory: Path) -> list[Path]:
    """Every rank file in ``directory``, in rank order."""
    return sorted(directory.glob("rank-*.pt"))


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested state (a checkpoint's, a set of weights)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensors(obj))


def _tensors(obj: Any, at: str = "") -> Iterator[tuple[str, str, torch.Tensor]]:
    """Every tensor of a nested state: (its path, its key, the tensor)."""
    if isinstance(obj, torch.Tensor):
        yield at, at.rsplit(".", 1)[-1], obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{at}.{k}" if at else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{at}[{i}]")


def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor copied (detached, same device and dtype) and its containers
    rebuilt: what a background write takes, so that training may change the live state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def moments(state: Any) -> int:
    """The AdamW moment tensors in a rank's state (either format)."""
    return sum(1 for _, key, _ in _tensors(state) if key in MOMENTS)


class _Hashing:
    """A write-only file over ``f``. Owns the running sha256 of what passes through it (what
    ``torch.save`` writes)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write(state: dict[str, Any], directory: Path, rank: int, header: dict[str, Any]) -> WrittenFile:
    """Write rank ``rank``'s ``state`` with ``header`` into ``directory``: under a temporary
    name, hashed as it goes, then renamed. Refused up front, or cleaned up, when the volume
    lacks the room (an ``OSError`` saying how much is needed)."""
    path = directory / name(rank)
    tmp = path.with_suffix(".pt.partial")
    needed = tensor_bytes(state)
    if shutil.disk_usage(directory).free < needed:
        raise _no_space(rank, needed, directory)
    try:
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            torch.save({**state, HEADER: header}, out)  # type: ignore[arg-type]  # _Hashing: a writer
    except (OSError, RuntimeError) as e:
        # torch's writer reports a full disk in its own words ("unexpected pos ..."): say
        # what happened when the volume is what ran out.
        full = shutil.disk_usage(directory).free < (1 << 20)
        tmp.unlink(missing_ok=True)
        if full or getattr(e, "errno", None) == errno.ENOSPC:
            raise _no_space(rank, needed, directory) from None
        raise
    os.replace(tmp, path)
    return WrittenFile(
        name=path.name, size_bytes=path.stat().st_size, sha256=out.sha.hexdigest(),
        moments=moments(state),
    )  # fmt: skip


def _no_space(rank: int, needed: int, directory: Path) -> OSError:
    free = shutil.disk_usage(directory).free
    return OSError(
        errno.ENOSPC,
        f"No space left on device: rank {rank}'s checkpoint shard needs about "
        f"{needed / 2**20:.1f} MiB and the checkpoint volume has {free / 2**20:.1f} MiB free; "
        "free space (fewer --keep-checkpoints, a larger volume) and save again",
    )


def read(path: Path, checkpoint_id: str, *, mmap: bool = False) -> dict[str, Any]:
    """A rank file's state (tensors and plain containers only); one that cannot be read is a
    ``CheckpointInvalidError`` naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise invalid(checkpoint_id, path.name, "the file is missing") from None
    except pickle.UnpicklingError:
        raise invalid(
            checkpoint_id,
            path.name,
            "the file cannot be read (it holds objects other than tensors and "
            "plain containers, which a weights-only load refuses)",
        ) from None
    except Exception as e:  # torch's reader: a truncated or foreign file
        text = str(e).strip()
        why = (
            "its zip archive is torn or it is no torch file" if "zip" in text
            else f"{type(e).__name__}: {text.splitlines()[0][:120] if text else ''}"
        )  # fmt: skip
        raise invalid(checkpoint_id, path.name, f"the file cannot be read ({why})") from None
    if not isinstance(state, dict):
        raise invalid(
            checkpoint_id, path.name, f"it holds a {type(state).__name__}, not a rank's state"
        )
    return state


def reader(directory: Path, checkpoint_id: str | None = None) -> Reader:
    """The reshardable reader of every rank file in ``directory`` (``mmap``: a rank reads
    only the pages it cuts from)."""
    cid = checkpoint_id or directory.name
    states = [read(p, cid, mmap=True) for p in rank_files(directory)]
    try:
        return Reader.of(states, f"checkpoint {cid!r}")
    except ValueError as e:
        raise invalid(cid, None, str(e)) from None


def invalid(checkpoint: CheckpointInfo | str, file: str | None, why: str) -> CheckpointInvalidError:
    """The refusal of ``checkpoint`` because of ``file`` (None: the whole checkpoint)."""
    cid = checkpoint if isinstance(checkpoint, str) else checkpoint.checkpoint_id
    where = f"{file}: " if file else ""
    return CheckpointInvalidError(
        f"checkpoint {cid!r} does not load: {where}{why}",
        details={"checkpoint_id": cid, "file": file, "problem": why},
    )


def share(directory: Path, info: CheckpointInfo, rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` proves: every ``world``-th of the checkpoint's
    (the manifest's list; a checkpoint saved before digests: the files on disk)."""
    names = (
        sorted(info.files) if info.files is not None else [p.name for p in rank_files(directory)]
    )
    if not names:
        raise invalid(info, None, "it holds no rank files")
    return names[rank::world]


def prove(directory: Path, info: CheckpointInfo, files: list[str], *, optimizer: bool) -> None:
    """Prove ``files`` of checkpoint ``info`` (in ``directory``) hold what its manifest says,
    or raise a ``CheckpointInvalidError`` naming the first that does not. A checkpoint saved
    before digests has only its tensors checked (finite). Several files are proved side by
    side (hashing and torch's reductions leave the GIL)."""
    if len(files) <= 1:
        for file in files:
            _prove_one(directory / file, info, optimizer=optimizer)
        return
    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1)) as pool:
        proofs = [pool.submit(_prove_one, directory / f, info, optimizer=optimizer) for f in files]
        for p in proofs:  # the first refusal in file order
            p.result()


def _prove_one(path: Path, info: CheckpointInfo, *, optimizer: bool) -> None:
    file = path.name
    want = info.files.get(file) if info.files is not None else None
    if info.files is not None:
        if want is None:
            raise invalid(info, file, "the manifest does not list it")
        _prove_bytes(path, info, want.size_bytes, want.sha256)
    state = read(path, info.checkpoint_id, mmap=True)
    if info.save_id is not None:
        _prove_header(state.get(HEADER), info, file)
    for at, _, t in _tensors(state):  # the header holds no tensor
        if not _finite(t):
            kind = "NaN" if bool(torch.isnan(t).any()) else "an infinity"
            raise invalid(info, file, f"{at} holds {kind}")
    if optimizer and want is not None and moments(state) < want.moments:
        raise invalid(
            info, file,
            f"it holds {moments(state)} AdamW moment tensors, the save wrote "
            f"{want.moments} (load with optimizer=false to start the optimizer afresh)",
        )  # fmt: skip


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: its sum first (one NaN or infinity makes the
    sum one, and summing allocates nothing), the values one by one only when the sum is not
    finite (then one is there, or the sum overflowed)."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _prove_bytes(path: Path, info: CheckpointInfo, size: int, sha256: str) -> None:
    try:
        got = path.stat().st_size
        if got != size:
            raise invalid(info, path.name, f"it has {got} bytes, the save wrote {size}")
        sha = hashlib.sha256()
        if size:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                sha.update(m)  # from the page cache, no copy; hashlib leaves the GIL
    except FileNotFoundError:
        raise invalid(info, path.name, "the file is missing") from None
    if sha.hexdigest() != sha256:
        raise invalid(
            info, path.name,
            "its bytes differ from what the save wrote (sha256 "
            f"{sha.hexdigest()[:12]}..., the manifest says {sha256[:12]}...)",
        )  # fmt: skip


def _prove_header(header: Any, info: CheckpointInfo, file: str) -> None:
    if not isinstance(header, dict):
        raise invalid(info, file, "it carries no header (it is not this save's file)")
    if header.get("save_id") != info.save_id:
        raise invalid(
            info, file,
            f"it belongs to save {header.get('save_id')} (step {header.get('step')}), "
            f"not to this checkpoint's save {info.save_id}",
        )  # fmt: skip
    if header.get("step") != info.step:
        raise invalid(
            info,
            file,
            f"it was written at step {header.get('step')}, the manifest says {info.step}",
        )
    if header.get("layout") != info.layout:
        raise invalid(
            info, file,
            f"it was written by layout {header.get('layout')}, the manifest says {info.layout}",
        )  # fmt: skip
