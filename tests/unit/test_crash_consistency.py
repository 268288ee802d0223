"""Checkpoints under SIGKILL: a process saving checkpoints in a loop is killed at 20 random
moments (one data directory, as restarts would find it); after each kill, only complete
checkpoints are listed, the latest loads whole, and no torn file is ever read. The same with
background saves (``--async-save``: each rank's file written by a thread while training
goes on, the checkpoint committed once both are written), at 4 kills (each a fresh process
that imports torch)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainctl.api import CheckpointInfo
from trainctl.workers.control.checkpoints import CheckpointStore

SAVER = r"""
import sys
from pathlib import Path
from trainctl.workers.control.checkpoints import CheckpointStore

store = CheckpointStore(Path(sys.argv[1]), keep=3)
step = int(sys.argv[2])
while True:
    step += 1
    tmp = store.begin(step)
    for rank in range(2):  # each shard: its step, repeated to a size that takes a while
        (tmp / f"rank-{rank:05d}.pt").write_bytes(f"{step:08d}".encode() * (1 << 16))
    store.commit(tmp, {"step": step, "layout": {"dp": 2}, "weights_digest": str(step)})
    print(step, flush=True)
"""


def _complete(store: CheckpointStore, checkpoint_id: str) -> bool:
    """The checkpoint's files are whole and say its step, as its manifest says."""
    path, info = store.path(checkpoint_id)
    files = sorted(path.glob("rank-*.pt"))
    want = f"{info.step:08d}".encode() * (1 << 16)
    sizes = sum(f.stat().st_size for f in files)
    return (
        len(files) == 2
        and all(f.read_bytes() == want for f in files)
        and (sizes == info.size_bytes)
    )


def _kill_at_random(
    saver: str, root: Path, step: int, rng: random.Random
) -> tuple[list[CheckpointInfo], CheckpointStore]:
    """Run ``saver`` from ``step`` until it saved once, SIGKILL it at a random moment after,
    and look as a restart would: the checkpoints listed (at least one), and the store."""
    proc = subprocess.Popen(
        [sys.executable, "-c", saver, str(root), str(step)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.readline()  # at least one save done: the kill lands mid-run
    time.sleep(rng.uniform(0.0, 0.3))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    store = CheckpointStore(root, keep=3)  # a restart
    found = store.list().checkpoints
    assert found, "every run saved at least once"
    return found, store


def test_twenty_random_kills_never_leave_a_torn_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20261124)
    root = tmp_path / "checkpoints"
    step, kills, listed = 0, 0, 0
    for _ in range(20):
        found, store = _kill_at_random(SAVER, root, step, rng)
        kills += 1
        for c in found:
            assert _complete(store, c.checkpoint_id), c
        latest = store.latest()
        assert latest is not None and latest.step == max(c.step for c in found)
        manifest = json.loads((root / latest.checkpoint_id / "manifest.json").read_text())
        assert manifest["step"] == latest.step
        listed += len(found)
        store.sweep_partial()
        assert not list(root.glob(".partial-*"))
        step = latest.step
    assert kills == 20 and step >= 20 and listed >= 20


ASYNC_SAVER = r"""
import sys, time
from pathlib import Path
import torch
from trainctl.workers.control.checkpoints import CheckpointStore
from trainctl.workers.engine.checkpoint import files
from trainctl.workers.rank.background_save import BackgroundSave

store = CheckpointStore(Path(sys.argv[1]), keep=3)
step = int(sys.argv[2])
live = torch.zeros(1 << 18)
ranks = [BackgroundSave(), BackgroundSave()]
while True:
    step += 1
    live.fill_(step)  # the step: the state each save must hold is this one
    tmp = store.begin(step)
    header = {"save_id": f"s{step}", "step": step, "layout": {"dp": 2}}
    for rank, save in enumerate(ranks):
        save.start(files.snapshot({"w": live}), tmp, rank, header)
    written = [None, None]
    while None in written:  # training goes on meanwhile: the live state moves on
        live.add_(0.5)
        written = [save.written() for save in ranks]
        time.sleep(0.001)
    info = {"step": step, "layout": {"dp": 2}, "weights_digest": str(step), "save_id": f"s{step}",
            "format": "per_rank",
            "files": {w.name: {"size_bytes": w.size_bytes, "sha256": w.sha256, "moments": 0}
                      for w in written}}
    store.commit(tmp, info)
    print(step, flush=True)
"""


def test_random_kills_of_background_saves_never_leave_a_torn_checkpoint(
    tmp_path: Path,
) -> None:
    import torch

    from trainctl.workers.engine.checkpoint import files

    rng = random.Random(20261128)
    root = tmp_path / "checkpoints"
    step = 0
    for _ in range(4):
        found, store = _kill_at_random(ASYNC_SAVER, root, step, rng)
        for c in found:  # each proves its bytes and header, and holds its own step's state
            path, info = store.path(c.checkpoint_id)
            files.prove(path, info, sorted(info.files), optimizer=False)
            for name in info.files:
                w = files.read(path / name, c.checkpoint_id)["w"]
                assert torch.equal(w, torch.full_like(w, float(c.step))), (c.checkpoint_id, name)
        latest = store.latest()  # what a recovery restores: the newest complete one
        assert latest is not None and latest.step == max(c.step for c in found)
        store.sweep_partial()
        assert not list(root.glob(".partial-*"))
        step = latest.step
    assert step >= 4
