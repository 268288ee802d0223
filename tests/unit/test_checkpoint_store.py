"""Checkpoint directories: invisible until complete, replaced atomically, pruned, swept."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.api import ConflictError, InvalidRequestError, NotFoundError
from trainctl.workers.control.checkpoints import CheckpointStore


def _write(store: CheckpointStore, step: int, payload: bytes) -> Path:
    tmp = store.begin(step)
    (tmp / "rank-00000.pt").write_bytes(payload)
    return tmp


def _info(step: int) -> dict:
    return {"step": step, "layout": {"dp": 2}, "weights_digest": f"d{step}"}


def test_a_checkpoint_is_invisible_until_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    good = store.commit(_write(store, 10, b"good"), _info(10))
    crashed = _write(store, 20, b"half")  # a crash before commit: never listed, never latest
    assert [c.checkpoint_id for c in store.list().checkpoints] == ["step-000010"]
    assert store.latest() == good
    with pytest.raises((InvalidRequestError, NotFoundError)):
        store.path(crashed.name)
    store.sweep_partial()
    assert (
        not crashed.exists()
        and (tmp_path / "step-000010" / "rank-00000.pt").read_bytes() == b"good"
    )


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.commit(_write(store, 5, b"old"), _info(5))
    store.commit(_write(store, 5, b"new"), _info(5))
    path, info = store.path("step-000005")
    assert (path / "rank-00000.pt").read_bytes() == b"new" and info.size_bytes > 0
    assert [p.name for p in tmp_path.iterdir()] == ["step-000005"]


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.commit(_write(store, step, b"x"), _info(step))
    assert [c.step for c in store.list().checkpoints] == [2, 3]


@pytest.mark.parametrize("bad", ["../etc", "..", ".partial-x", "a/b"])
def test_ids_cannot_leave_the_root(tmp_path: Path, bad: str) -> None:
    with pytest.raises((InvalidRequestError, NotFoundError)):
        CheckpointStore(tmp_path).path(bad)


def test_named_checkpoints_are_kept_and_not_overwritten_unasked(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.commit(_write(store, 1, b"named"), _info(1), name="before-ppo")
    for step in (2, 3):
        store.commit(_write(store, step, b"auto"), _info(step))
    ids = [c.checkpoint_id for c in store.list().checkpoints]
    assert ids == ["before-ppo", "step-000003"]  # keep=1 prunes only the unnamed ones
    with pytest.raises(ConflictError, match=r"before-ppo.*overwrite"):
        store.check_name("before-ppo", overwrite=False)
    store.check_name("before-ppo", overwrite=True)
    store.check_name("other", overwrite=False)
