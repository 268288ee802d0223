"""Step metrics to the experiment tracker a user names (``--metrics-log``).

After every finished step operation the controller hands its result here: ``train/...`` for
``train_batch`` and ``optim_step``, ``eval/...`` for ``eval_batch``, each metric under its
own name (``train/loss:mean``, ``train/grad_norm:value``, ``train/time/total_s``, ...) at the
model's step. Writing uses the tracker library's own writer, never hand-made files.

``--metrics-log`` names one or more (comma-separated):

* ``tensorboard:DIR``: TensorBoard event files in ``DIR`` (relative to the data directory),
  read by ``tensorboard --logdir DIR``;
* ``mlflow:URI``: a run in MLflow's experiment ``trainctl``, on the tracking server at
  ``URI`` (``http(s)://...``) or, for a directory (relative to the data directory), in
  MLflow's file store there (which MLflow 3 keeps for local use behind
  ``MLFLOW_ALLOW_FILE_STORE``; trainctl sets it for that case only);
* ``wandb`` or ``wandb:PROJECT``: a Weights & Biases run (project ``trainctl`` by default),
  online or offline as ``WANDB_MODE`` and the usual ``WANDB_*`` settings say, its files under
  the data directory.

A tracker that fails to write logs a warning: metrics never fail a step.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from trainctl.api import OperationKind, StepResult

log = logging.getLogger(__name__)

PREFIX = {
    OperationKind.TRAIN_BATCH: "train",
    OperationKind.OPTIM_STEP: "train",
    OperationKind.EVAL_BATCH: "eval",
}
"""The operations whose results are logged, and the prefix of their metrics."""


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars through TensorBoard's own event-file writer (no TensorFlow, no torch)."""

    def __init__(self, logdir: Path) -> None:
        writer = _library("tensorboard", "tensorboard.summary.writer.event_file_writer")
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = writer.EventFileWriter(str(logdir), flush_secs=10)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        event = event_pb2.Event(
            wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)
        )
        self.writer.add_event(event)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """Metrics through MLflow's own client: one run per service start."""

    def __init__(self, where: str, data_dir: Path) -> None:
        tracking = _library("mlflow", "mlflow.tracking")
        if "://" in where:
            uri = where
        else:
            directory = (data_dir / where).resolve()
            directory.mkdir(parents=True, exist_ok=True)
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            uri = directory.as_uri()
        self.client = tracking.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(EXPERIMENT)
        experiment = found.experiment_id if found else self.client.create_experiment(EXPERIMENT)
        self.run_id: str = self.client.create_run(experiment, run_name=_run_name()).info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """Metrics through the ``wandb`` library's own run (online or offline: ``WANDB_MODE``)."""

    def __init__(self, project: str, data_dir: Path) -> None:
        wandb = _library("wandb", "wandb")
        data_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project or EXPERIMENT, dir=str(data_dir),
                              name=_run_name(), reinit="create_new")  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run, then stop W&B's service process: ``finish()`` returns before that
        process has written the run's last records to its ``.wandb`` file (it closes the file
        on its own time, or at interpreter exit, which a Ray actor's end may skip).
        ``teardown()`` waits for it."""
        self.run.finish()
        _library("wandb", "wandb").teardown()


EXPERIMENT = "trainctl"
"""MLflow's experiment and W&B's default project."""


def _library(package: str, module: str) -> Any:
    """``module`` of a tracker's library, or the ValueError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"metrics_log: {package} is not installed; pip install 'trainctl[tracking]'"
        ) from None


def _run_name() -> str:
    return time.strftime("trainctl-%Y%m%d-%H%M%S")


def _inside(data_dir: Path, where: str) -> Path:
    """``data_dir / where``, a ValueError naming ``metrics_log`` if it would leave the data
    directory (an absolute path, ``..``, a symlink out)."""
    root = data_dir.resolve()
    path = (root / where).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f"metrics_log: {where!r} leaves the data directory; name a directory inside it"
        )
    return path


LIBRARIES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Each tracker's package (its pip name and top-level module)."""


def check_trackers(spec: str | None, data_dir: Path) -> None:
    """What ``open_trackers`` would refuse, said before anything starts (``trainctl serve``
    checks its settings with it): a ValueError naming ``metrics_log``. Opens nothing."""
    for kind, _ in _parsed(spec, data_dir):
        if importlib.util.find_spec(LIBRARIES[kind]) is None:
            raise ValueError(
                f"metrics_log: {kind} is not installed; pip install 'trainctl[tracking]'"
            )


def _parsed(spec: str | None, data_dir: Path) -> list[tuple[str, str]]:
    """``spec``'s trackers as ``(kind, where)``; a ValueError naming ``metrics_log`` for an
    unknown kind, a missing place, or a directory outside ``data_dir``."""
    out = []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        kind, _, where = item.partition(":")
        if kind not in LIBRARIES:
            raise ValueError(
                f"metrics_log: {kind!r} is not a tracker trainctl writes to; use "
                "tensorboard:DIR, mlflow:URI or wandb[:PROJECT]"
            )
        if kind in ("tensorboard", "mlflow") and not where:
            raise ValueError(f"metrics_log: {kind} needs a place ({kind}:DIR)")
        if kind == "tensorboard" or (kind == "mlflow" and "://" not in where):
            _inside(data_dir, where)
        out.append((kind, where))
    return out


def open_trackers(spec: str | None, data_dir: Path) -> list[Tracker]:
    """The trackers ``spec`` names (comma-separated ``kind:where``); a ValueError naming
    ``metrics_log`` for anything else."""
    out: list[Tracker] = []
    for kind, where in _parsed(spec, data_dir):
        if kind == "tensorboard":
            out.append(TensorBoardTracker(_inside(data_dir, where)))
        elif kind == "mlflow":
            out.append(MlflowTracker(where, data_dir))
        else:
            out.append(WandbTracker(where, data_dir))
    return out


def step_metrics(kind: OperationKind, result: Any) -> tuple[dict[str, float], int] | None:
    """What a finished operation logs: its prefixed metrics and timings, and its step."""
    prefix = PREFIX.get(kind)
    if prefix is None or not isinstance(result, StepResult):
        return None
    metrics = {f"{prefix}/loss": float(result.loss)}
    metrics.update({f"{prefix}/{k}": float(v) for k, v in result.metrics.items()})
    metrics.update({f"{prefix}/time/{k}": float(v) for k, v in result.timings.items()})
    total = result.timings.get("total_s")
    tokens = result.metrics.get("tokens:sum")
    if total and tokens:
        metrics[f"{prefix}/tokens_per_s"] = tokens / total
    return metrics, result.step


class TrackerLog:
    """The controller's queue listener: every finished step operation, to every tracker. Owns its
    trackers."""

    def __init__(
        self, trackers: list[Tracker], utilization: Callable[[], dict[str, float]] | None = None
    ) -> None:
        self.trackers = trackers
        self.utilization = utilization
        """Each component's busy share now, logged with each step as ``utilization/*``."""

    def observe(self, kind: OperationKind, result: Any) -> None:
        found = step_metrics(kind, result)
        if found is None or not self.trackers:
            return
        if self.utilization is not None:
            found[0].update({f"utilization/{k}": v for k, v in self.utilization().items()})
        for t in self.trackers:
            try:
                t.log(*found)
            except Exception:
                log.warning("metrics_log: %s failed to write", type(t).__name__, exc_info=True)

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception:
                log.warning("metrics_log: %s failed to close", type(t).__name__, exc_info=True)
