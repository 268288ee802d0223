"""Step metrics to the experiment tracker a user names (``--metrics-log``).

After every finished step operation the controller hands its result here: ``train/...`` for
``train_batch`` and ``optim_step``, ``eval/...`` for ``eval_batch``, each metric under its
own name (``train/loss:mean``, ``train/grad_norm:value``, ``train/time/total_s``, ...) at the
model's step. Writing uses the tracker library's own writer, never hand-made files.

``--metrics-log tensorboard:DIR`` writes TensorBoard event files into ``DIR`` (relative to
the data directory), read by ``tensorboard --logdir DIR``. A tracker that fails to write
logs a warning: metrics never fail a step.
"""

from __future__ import annotations

import logging
import time
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
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ValueError(
                "metrics_log: tensorboard is not installed; pip install 'trainctl[tracking]'"
            ) from None
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir), flush_secs=10)

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


def open_trackers(spec: str | None, data_dir: Path) -> list[Tracker]:
    """The trackers ``spec`` names (comma-separated ``kind:where``); a ValueError naming
    ``metrics_log`` for anything else."""
    out: list[Tracker] = []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        kind, _, where = item.partition(":")
        if kind == "tensorboard":
            if not where:
                raise ValueError("metrics_log: tensorboard needs a directory (tensorboard:DIR)")
            out.append(TensorBoardTracker(data_dir / where))
        else:
            raise ValueError(
                f"metrics_log: {kind!r} is not a tracker trainctl writes to; use tensorboard:DIR"
            )
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
    """The controller's queue listener: every finished step operation, to every tracker."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def observe(self, kind: OperationKind, result: Any) -> None:
        found = step_metrics(kind, result)
        if found is None:
            return
        for t in self.trackers:
            try:
                t.log(*found)
            except Exception:
                log.warning("metrics_log: %s failed to write", type(t).__name__, exc_info=True)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
