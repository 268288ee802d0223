"""``--metrics-log``: a real controller's step metrics, written by each tracker library's own
writer and read back with that library's reader (TensorBoard's event accumulator, MLflow's
client; W&B's offline run file, record by record)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from trainctl.api import OperationKind, OptimStepRequest, StepResult
from trainctl.api.models import Normalization
from trainctl.workers.control.steps import Window

from helpers.fake_ranks import controller


def _two_steps(tmp_path: Path, metrics_log: str) -> list[StepResult]:
    """Two optimizer steps of a controller over fake ranks (loss 0.5 each), trackers closed."""
    c, _ = controller(tmp_path, metrics_log=metrics_log)

    async def step() -> StepResult:
        c.state.window = Window(Normalization.TOKEN_MEAN, parts=1, loss_tokens=4, raw_loss=2.0)
        result: StepResult = await c.run(OperationKind.OPTIM_STEP, OptimStepRequest(), None, "")
        return result

    async def main() -> list[StepResult]:
        await c.start()
        return [await step(), await step()]

    results = asyncio.run(main())
    c.trackers.close()
    return results


def _expected(results: list[StepResult]) -> list[tuple[int, Any]]:
    want = [(r.step, pytest.approx(r.loss)) for r in results]
    assert want == [(1, pytest.approx(0.5)), (2, pytest.approx(0.5))]
    return want


def test_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = _two_steps(tmp_path, "tensorboard:tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == _expected(results)
    assert "train/grad_norm:value" in events.Tags()["scalars"]


def test_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    results = _two_steps(tmp_path, "mlflow:mlruns")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("trainctl").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == _expected(results)
    assert "train/grad_norm:value" in run.data.metrics
    assert run.info.status == "FINISHED"


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run: its ``.wandb`` file is a LevelDB-style log
    (32 KiB blocks of records: crc32c, length, type) after a 7-byte W&B header, each record
    one of W&B's own ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, rows, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the block's padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in items})  # fmt: skip
    return rows


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    results = _two_steps(tmp_path, "wandb:trainctl-test")
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    assert [(r["_step"], r["train/loss"]) for r in rows] == _expected(results)
    assert all("train/grad_norm:value" in r for r in rows)


def test_an_unknown_tracker_is_refused_by_name(tmp_path: Path) -> None:
    from trainctl.workers.control.trackers import open_trackers

    with pytest.raises(ValueError, match=r"metrics_log: 'neptune' is not a tracker"):
        open_trackers("neptune:x", tmp_path)
    with pytest.raises(ValueError, match=r"metrics_log: mlflow needs a place"):
        open_trackers("mlflow", tmp_path)


@pytest.mark.parametrize("spec", ["tensorboard:../x", "tensorboard:/tmp/x", "mlflow:a/../../x"])
def test_a_tracker_directory_stays_inside_the_data_dir(tmp_path: Path, spec: str) -> None:
    from trainctl.workers.control.trackers import open_trackers

    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(ValueError, match=r"metrics_log: .* leaves the data directory"):
        open_trackers(spec, data)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["data"]  # nothing written
