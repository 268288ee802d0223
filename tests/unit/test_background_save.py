"""A rank's background checkpoint write (``--async-save``): the file it writes is the one the
synchronous save writes, hashed as written; its failure is reported, never lost; one at a
time; and the state it is given is a copy that training may not change."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainctl.workers.engine.checkpoint import files
from trainctl.workers.rank.background_save import BackgroundSave

HEADER = {"save_id": "s", "step": 3, "layout": {"dp": 1}}


def _wait(save: BackgroundSave) -> Any:
    for _ in range(500):
        got = save.written()
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("the write never finished")


def test_the_background_write_is_the_synchronous_one(tmp_path: Path) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sync = files.write(state, tmp_path / "a", 0, HEADER)
    save = BackgroundSave()
    save.start(state, tmp_path / "b", 0, HEADER)
    got = _wait(save)
    assert (got.name, got.size_bytes, got.sha256) == (sync.name, sync.size_bytes, sync.sha256)
    data = (tmp_path / "b" / got.name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == got.sha256
    assert torch.equal(files.read(tmp_path / "b" / got.name, "c")["w"], state["w"])
    assert save.written() == got  # asked again (another rank was slower): the same answer


def test_a_failed_write_is_raised_by_written(tmp_path: Path) -> None:
    save = BackgroundSave()
    save.start({"w": torch.zeros(4)}, tmp_path / "missing", 0, HEADER)
    with pytest.raises(OSError):
        _wait(save)


def test_one_write_at_a_time_and_none_asked_before_one_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = BackgroundSave()
    with pytest.raises(RuntimeError, match="no checkpoint write was started"):
        save.written()
    release = threading.Event()

    def slow(*args: Any) -> Any:
        release.wait(10)
        return "written"

    monkeypatch.setattr(files, "write", slow)
    save.start({}, tmp_path, 0, HEADER)
    assert save.busy and save.written() is None
    with pytest.raises(RuntimeError, match="already in flight"):
        save.start({}, tmp_path, 0, HEADER)
    release.set()
    assert _wait(save) == "written" and not save.busy


def test_a_snapshot_does_not_follow_the_live_state() -> None:
    live = {"chunks": [{"w": torch.ones(3)}], "opt": ({"m": torch.zeros(2)},), "step": 1}
    copy = files.snapshot(live)
    live["chunks"][0]["w"].add_(1)
    live["opt"][0]["m"].add_(5)
    assert torch.equal(copy["chunks"][0]["w"], torch.ones(3))
    assert torch.equal(copy["opt"][0]["m"], torch.zeros(2))
    assert copy["step"] == 1 and isinstance(copy["opt"], tuple)
