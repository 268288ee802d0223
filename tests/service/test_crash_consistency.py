"""Crash consistency of the real service: killed mid-save or mid-export, and out of disk.

After a SIGKILL at a random moment of a checkpoint save or an export (of the controller
alone, or of the whole process group), the restarted service lists only complete
checkpoints, each of which loads, resumes from the newest of them, and has swept every
half-written export. ``TRAINCTL_KILL_POINTS`` sets how many random kill points each case
gets (CI: one, on two of the four cases; the note's figure: 20 on all four). A full disk
during a save is a clear error, and the previous checkpoint stays loadable.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from servicekit import fresh_home

from trainctl.api import TrainctlError
from trainctl.service.local import LocalService

KILL_POINTS = int(os.environ.get("TRAINCTL_KILL_POINTS", "1"))
CASES = (
    [(w, v) for w in ("save", "export") for v in ("controller", "process-group")]
    if "TRAINCTL_KILL_POINTS" in os.environ
    else [("save", "controller"), ("export", "process-group")]
)
"""CI: one kill point of two cases; ``TRAINCTL_KILL_POINTS=20``: every case, 20 points."""
BATCH = [{"tokens": [3, 1, 4, 1, 5, 9, 2, 6], "loss_mask": [0, 1, 1, 1, 1, 1, 1, 1]}]


def _service(data: Path, *flags: str) -> LocalService:
    return LocalService(data, "--dp", "1", *flags, start_timeout_s=300, env=fresh_home(data))


def _controller_pid(svc: LocalService) -> int:
    """The controller actor's process, in the service's process session."""
    assert svc.proc is not None
    out = subprocess.run(["pgrep", "-s", str(svc.proc.pid), "-f", "ray::Controller"],
                         capture_output=True, text=True)  # fmt: skip
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out
    return pids[0]


def _busy_until_killed(svc: LocalService, work: str, stop: threading.Event) -> None:
    """Save checkpoints (or exports) back to back, with a step between, until killed."""
    with contextlib.suppress(Exception), svc.client() as tc:
        i = 0
        while not stop.is_set():
            tc.train_batch(BATCH)
            if work == "save":
                tc.save_checkpoint()
            else:
                tc.export_hf(f"e{i}")
            i += 1


def _check_restart(data: Path) -> int:
    """Start again on ``data``: every listed checkpoint is complete and loads, the service
    resumed from the newest, and no half-written export is left. Returns the checkpoints."""
    with _service(data) as svc, svc.client() as tc:
        listed = tc.list_checkpoints().checkpoints
        step = tc.info().step
        if listed:
            newest = max(listed, key=lambda c: c.sequence)
            assert step == newest.step, (step, newest)
        for c in listed:
            assert tc.load_checkpoint(c.checkpoint_id).step == c.step
        exports = data / "exports"
        leftovers = [p.name for p in exports.glob(".partial-*")] if exports.is_dir() else []
        assert leftovers == [], leftovers
        for e in exports.iterdir() if exports.is_dir() else []:
            assert {"config.json", "model.safetensors"} <= {f.name for f in e.iterdir()}, e
        return len(listed)


@pytest.mark.parametrize(("work", "victim"), CASES)
def test_a_kill_mid_write_leaves_only_complete_state(
    tmp_path: Path, work: str, victim: str
) -> None:
    rng = random.Random(f"{work}-{victim}")
    data = tmp_path / "data"
    kept = 0
    for point in range(KILL_POINTS):
        svc = _service(data, "--keep-checkpoints", "2").start()
        stop = threading.Event()
        t = threading.Thread(target=_busy_until_killed, args=(svc, work, stop), daemon=True)
        t.start()
        time.sleep(rng.uniform(1.0, 4.0))  # a random moment of the save / export loop
        if victim == "controller":
            os.kill(_controller_pid(svc), signal.SIGKILL)
            time.sleep(0.5)
        svc.kill()  # the rest of the process group
        stop.set()
        t.join(30)
        kept = _check_restart(data)
        print(f"{work}, {victim} killed, point {point}: {kept} complete checkpoint(s)")
    if work == "save":
        assert kept >= 1, "no checkpoint ever completed: the kill points missed the saves"


def test_a_full_disk_during_a_save_is_a_clear_error(tmp_path: Path) -> None:
    """The checkpoint root on a tmpfs that holds one checkpoint: the second save fails
    with the disk's own words, nothing half-written is listed, and the first still loads."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs: run it as root (CI does)")
    data = tmp_path / "data"
    root = data / "checkpoints"
    root.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], check=True)
    try:
        with _service(data) as svc, svc.client() as tc:
            tc.train_batch(BATCH)
            first = tc.save_checkpoint()
            used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
            size_kib = (used + first.size_bytes // 2) // 1024 + 64
            subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(root)], check=True)
            tc.train_batch(BATCH)
            with pytest.raises(TrainctlError) as err:
                tc.save_checkpoint()
            assert "No space left on device" in str(err.value), err.value
            assert [c.checkpoint_id for c in tc.list_checkpoints().checkpoints] == [
                first.checkpoint_id
            ]
            assert tc.load_checkpoint(first.checkpoint_id).step == first.step
            assert tc.info().step == first.step
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
