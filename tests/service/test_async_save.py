"""Scheduled checkpoints written in the background (``--async-save``) with the real service:
the saving step waits only for the copy, the checkpoint is listed once every rank's file is
written and loads bit for bit, and a write that runs out of disk shows in ``info`` while the
step stands. One service (dp=2, a checkpoint every step) with its checkpoints on a tmpfs."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from trainctl.clients import TrainctlClient

from helpers.batches import sft_batch
from helpers.servicekit import Service, digest, running_service


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if os.geteuid() != 0:
        pytest.fail("this module mounts a tmpfs for the checkpoints: run it as root (CI does)")
    data = tmp_path_factory.mktemp("async_save")
    root = data / "checkpoints"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], check=True)
    try:
        flags = ("--async-save=true", "--checkpoint-every-steps=1", "--keep-checkpoints=2")
        with running_service(data, *flags) as s:
            yield s
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def settled(c: TrainctlClient) -> None:
    deadline = time.monotonic() + 60
    while c.info().save_in_flight is not None:
        assert time.monotonic() < deadline, "the background save never finished"
        time.sleep(0.05)


def test_a_background_save_is_listed_once_written_and_loads_bit_for_bit(svc: Service) -> None:
    c = TrainctlClient(svc.url, timeout=300)
    first = c.train_batch(sft_batch(seed=1))
    at_save = c.info()  # the weights the step-1 save copied
    second = c.train_batch(sft_batch(seed=2))  # runs while step 1's file may still be written
    assert (first.step, second.step) == (1, 2)
    settled(c)
    info = c.info()
    assert info.last_save_error is None
    listed = {k.step: k for k in c.list_checkpoints().checkpoints}
    assert sorted(listed) == [1, 2]
    assert listed[1].weights_digest == at_save.weights_digest
    assert not list((svc.data_dir / "checkpoints").glob(".partial-*"))
    loaded = c.load_checkpoint(listed[1].checkpoint_id)
    assert loaded.step == 1 and digest(c.info().weights_digest) == digest(at_save.weights_digest)


def test_a_background_save_out_of_disk_shows_in_info_and_the_step_stands(svc: Service) -> None:
    c = TrainctlClient(svc.url, timeout=300)
    settled(c)
    root = svc.data_dir / "checkpoints"
    before = [k.checkpoint_id for k in c.list_checkpoints().checkpoints]
    newest = c.list_checkpoints().checkpoints[-1]
    used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    size_kib = (used + newest.size_bytes // 4) // 1024 + 64  # room for a quarter of a save
    subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(root)], check=True)
    try:
        step = c.info().step
        stepped = c.train_batch(sft_batch(seed=3))
        assert stepped.step == step + 1  # the step stands: the save is after it
        settled(c)
        info = c.info()
        assert info.step == step + 1
        assert info.last_save_error is not None, info
        assert f"step {step + 1}" in info.last_save_error
        assert "No space left on device" in info.last_save_error
        assert [k.checkpoint_id for k in c.list_checkpoints().checkpoints] == before
        assert not list(root.glob(".partial-*"))  # the failed save's directory is gone
    finally:
        subprocess.run(["mount", "-o", "remount,size=64m", str(root)], check=True)
    c.train_batch(sft_batch(seed=4))  # room again: the next save succeeds and clears it
    settled(c)
    assert c.info().last_save_error is None
    assert c.list_checkpoints().checkpoints[-1].step == step + 2
