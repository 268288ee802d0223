"""A checkpoint's rank files proved against their manifest (workers/engine/checkpoint/files.py):
written through the real writer, then damaged the ways a probe damaged them (changed bytes,
another save's file, a forged step, NaN, moments dropped, a truncated or missing file); each
is refused naming the file, and every file is proved by exactly one loading rank whatever
the number of loading ranks."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch

from trainctl.api import CheckpointFile, CheckpointInfo, CheckpointInvalidError
from trainctl.workers.engine.checkpoint import files

LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1}


def _state(seed: int, *, moments: bool = True, nan: bool = False) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    piece: dict[str, object] = {"lo": 0, "hi": 64, "param": torch.randn(64, generator=g)}
    if moments:
        piece["exp_avg"] = torch.randn(64, generator=g)
        piece["exp_avg_sq"] = torch.rand(64, generator=g)
    if nan:
        piece["param"][7] = float("nan")  # type: ignore[index]
    return {"format": "reshardable-1", "pieces": {"decoder.w": piece}, "meta": {"step": 5}}


def _save(
    root: Path, name: str = "ck", step: int = 5, ranks: int = 2, **kw: bool
) -> tuple[Path, CheckpointInfo]:
    """Rank files written by ``files.write`` and the manifest the controller would commit."""
    d = root / name
    d.mkdir(parents=True)
    header = {"save_id": uuid.uuid4().hex, "step": step, "layout": LAYOUT}
    written = [files.write(_state(100 * step + r, **kw), d, r, header) for r in range(ranks)]
    info = CheckpointInfo(
        checkpoint_id=name, step=step, created_at=0.0, layout=LAYOUT, weights_digest="",
        size_bytes=sum(f.size_bytes for f in written), save_id=header["save_id"],
        files={f.name: CheckpointFile(size_bytes=f.size_bytes, sha256=f.sha256,
                                      moments=f.moments) for f in written},
    )  # fmt: skip
    return d, info


def _prove_all(d: Path, info: CheckpointInfo, world: int = 1, optimizer: bool = True) -> None:
    for rank in range(world):
        files.prove(d, info, files.share(d, info, rank, world), optimizer=optimizer)


def _refused(d: Path, info: CheckpointInfo, file: str | None, *words: str, **kw: bool) -> str:
    with pytest.raises(CheckpointInvalidError) as e:
        _prove_all(d, info, **kw)
    assert e.value.status == 409 and e.value.details["file"] == file, e.value.details
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value.message


def test_the_writer_hashes_what_lands_on_disk_and_counts_the_moments(tmp_path: Path) -> None:
    import hashlib

    d, info = _save(tmp_path)
    assert info.files is not None and sorted(info.files) == ["rank-00000.pt", "rank-00001.pt"]
    for name, f in info.files.items():
        assert f.sha256 == hashlib.sha256((d / name).read_bytes()).hexdigest()
        assert f.moments == 2
    state = files.read(d / "rank-00001.pt", "ck")
    assert state[files.HEADER] == {"save_id": info.save_id, "step": 5, "layout": LAYOUT}
    _prove_all(d, info)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_file_is_proved_by_exactly_one_loading_rank(tmp_path: Path, world: int) -> None:
    d, info = _save(tmp_path, ranks=4)
    shares = [files.share(d, info, r, world) for r in range(world)]
    flat = [f for s in shares for f in s]
    assert sorted(flat) == sorted(info.files or {}) and len(flat) == len(set(flat)) == 4


def test_changed_bytes_are_refused_naming_the_file(tmp_path: Path) -> None:
    d, info = _save(tmp_path)
    state = files.read(d / "rank-00001.pt", "ck")
    state["pieces"]["decoder.w"]["param"][3] += 1.0  # an edit, saved again by hand
    torch.save(state, d / "rank-00001.pt")
    _refused(d, info, "rank-00001.pt", "the save wrote")
    _, info = _save(tmp_path, "flipped")  # one byte changed in place: same size
    path = tmp_path / "flipped" / "rank-00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _refused(tmp_path / "flipped", info, "rank-00000.pt", "differ from what the save wrote")


def test_a_file_of_another_save_is_refused(tmp_path: Path) -> None:
    """Copied in from another save of the same step, with that save's digest put in the
    manifest too: its header names the other save."""
    d, info = _save(tmp_path, "a")
    other, other_info = _save(tmp_path, "b")
    shutil.copy(other / "rank-00000.pt", d / "rank-00000.pt")
    assert info.files is not None and other_info.files is not None
    files_ = {**info.files, "rank-00000.pt": other_info.files["rank-00000.pt"]}
    mixed = info.model_copy(update={"files": files_})
    _refused(d, mixed, "rank-00000.pt", f"belongs to save {other_info.save_id}")


def test_a_forged_manifest_step_is_refused(tmp_path: Path) -> None:
    d, info = _save(tmp_path, step=530)
    forged = info.model_copy(update={"step": 999})
    _refused(d, forged, "rank-00000.pt", "written at step 530, the manifest says 999")


def test_non_finite_values_are_refused_by_name(tmp_path: Path) -> None:
    d, info = _save(tmp_path, nan=True)  # written (and hashed) as they were: NaN weights
    _refused(d, info, "rank-00000.pt", "pieces.decoder.w.param holds NaN")


def test_missing_moments_are_refused_only_where_the_manifest_counts_them(tmp_path: Path) -> None:
    d, info = _save(tmp_path, moments=False)
    assert info.files is not None
    _prove_all(d, info)  # saved without moments: a load needs none
    claimed = {n: f.model_copy(update={"moments": 2}) for n, f in info.files.items()}
    lying = info.model_copy(update={"files": claimed})
    _refused(d, lying, "rank-00000.pt", "0 AdamW moment tensors, the save wrote 2")
    _prove_all(d, lying, optimizer=False)  # optimizer=false: the moments are not read


def test_a_truncated_or_missing_file_is_refused(tmp_path: Path) -> None:
    d, info = _save(tmp_path)
    data = (d / "rank-00001.pt").read_bytes()
    (d / "rank-00001.pt").write_bytes(data[: len(data) // 2])
    _refused(d, info, "rank-00001.pt", f"has {len(data) // 2} bytes")
    (d / "rank-00001.pt").unlink()
    _refused(d, info, "rank-00001.pt", "missing")


def test_a_checkpoint_saved_before_digests_has_its_tensors_checked(tmp_path: Path) -> None:
    d, info = _save(tmp_path, nan=True)
    legacy = info.model_copy(update={"files": None, "save_id": None})
    _refused(d, legacy, "rank-00000.pt", "holds NaN")
    (d / "rank-00000.pt").write_bytes(b"not a zip")
    message = _refused(d, legacy, "rank-00000.pt", "cannot be read")
    assert "Traceback" not in message and len(message) < 400
