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


def test_latest_is_the_newest_save_not_the_highest_step(tmp_path: Path) -> None:
    """The review's case: after loading step 1 of a history that reached step 10, the new
    history's checkpoints were pruned at once and a recovery went back to step 10."""
    store = CheckpointStore(tmp_path, keep=3)
    for step in range(1, 11):
        store.commit(_write(store, step, b"old"), _info(step))
    # A load of step 1 happened (not kept: only step-8..10 are left); training goes on.
    new = store.commit(_write(store, 2, b"new"), _info(2))
    assert store.latest() == new
    assert (tmp_path / "step-000002" / "rank-00000.pt").read_bytes() == b"new"
    store.commit(_write(store, 3, b"new"), _info(3))
    store.commit(_write(store, 4, b"new"), _info(4))
    assert [c.step for c in store.list().checkpoints] == [2, 3, 4]  # the oldest saves pruned
    assert store.latest().step == 4  # type: ignore[union-attr]


def test_a_bad_manifest_is_skipped_not_fatal(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.commit(_write(store, 1, b"one"), _info(1))
    bad = tmp_path / "step-000007"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    assert [c.step for c in store.list().checkpoints] == [1]
    with pytest.raises(NotFoundError, match="unreadable"):
        store.path("step-000007")
    assert store.commit(_write(store, 2, b"two"), _info(2)).sequence == 2
    assert store.latest().step == 2  # type: ignore[union-attr]


def test_an_unreadable_automatic_checkpoint_is_pruned_in_its_turn(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    bad = tmp_path / "step-000001"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    named = tmp_path / "mine"  # a name, not an automatic id: never pruned, readable or not
    named.mkdir()
    (named / "manifest.json").write_text("{not json")
    store.commit(_write(store, 2, b"two"), _info(2))
    assert bad.exists()  # two kept, and it is one of them
    store.commit(_write(store, 3, b"three"), _info(3))
    assert not bad.exists() and named.exists()  # counted as the oldest of all
    assert [c.step for c in store.list().checkpoints] == [2, 3]


def test_each_owner_has_its_own_names(tmp_path: Path) -> None:
    service = CheckpointStore(tmp_path, keep=1)
    a, b = service.scoped("run-a"), service.scoped("run-b")
    first = a.commit(_write(a, 3, b"a3"), _info(3), "final")
    assert first.owner == "run-a" and first.checkpoint_id == "final"
    b.check_name("final", overwrite=False)  # another owner's 'final' is no conflict
    b.commit(_write(b, 5, b"b5"), _info(5), "final")
    with pytest.raises(ConflictError):
        a.check_name("final", overwrite=False)
    path, info = a.path("final")
    assert (path / "rank-00000.pt").read_bytes() == b"a3" and info.step == 3
    assert [c.checkpoint_id for c in service.list().checkpoints] == []  # not the service's
    with pytest.raises(NotFoundError, match="of 'run-b'"):
        b.path("other")
    with pytest.raises(InvalidRequestError, match="owner"):
        service.scoped("../run-a")
    for step in (1, 2):  # each owner's automatic ones are pruned among themselves
        a.commit(_write(a, step, b"x"), _info(step))
    assert [c.checkpoint_id for c in a.list().checkpoints] == ["final", "step-000002"]
    crashed = _write(b, 9, b"half")
    service.sweep_partial()  # one sweep at start covers every owner
    assert not crashed.exists() and b.path("final")[1].step == 5


def test_a_checkpoint_moved_into_an_owner_is_that_owners(tmp_path: Path) -> None:
    service = CheckpointStore(tmp_path)
    service.commit(_write(service, 4, b"old"), _info(4), "final")  # before owners existed
    owned = service.scoped("run-a")
    owned.root.mkdir(parents=True)
    (tmp_path / "final").rename(owned.root / "final")  # the documented upgrade step
    assert owned.path("final")[1].owner == "run-a"


def test_a_discarded_directory_leaves_nothing_listed_even_if_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``discard`` (checkpoint pruning and deletes, export deletes): renamed out of sight
    first, so a delete cut short leaves only a ``.partial-`` directory that the start sweeps;
    one gone already is no error."""
    import shutil

    from trainctl.workers.control import checkpoints

    export = tmp_path / "exports" / "final"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"x" * 10)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # the process dies mid-delete
    checkpoints.discard(export)
    left = list((tmp_path / "exports").iterdir())
    assert not export.exists() and len(left) == 1
    assert left[0].name.startswith(".partial-gone-final-")
    assert checkpoints.partials(tmp_path / "exports") == left  # what the start sweeps
    monkeypatch.undo()
    checkpoints.discard(export)  # gone already
