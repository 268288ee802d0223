"""Checkpoints under SIGKILL: a process saving checkpoints in a loop is killed at 20 random
moments (one data directory, as restarts would find it); after each kill, only complete
checkpoints are listed, the latest loads whole, and no torn file is ever read."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_twenty_random_kills_never_leave_a_torn_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20261124)
    root = tmp_path / "checkpoints"
    step, kills, listed = 0, 0, 0
    for _ in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(root), str(step)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one save done: the kill lands mid-run
        time.sleep(rng.uniform(0.0, 0.3))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        store = CheckpointStore(root, keep=3)  # a restart
        found = store.list().checkpoints
        assert found, "every run saved at least once"
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
