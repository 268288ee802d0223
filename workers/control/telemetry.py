"""The controller's Prometheus metrics: steps, tokens, latency, queue depth, errors by type.

One registry per controller (not prometheus_client's global one, which Ray uses too); the
gateway's ``/metrics`` appends this text to its own (``service/metrics.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from trainctl.api import LogProbsResult, OperationKind, OperationStatus, StepResult
from trainctl.workers import spans
from trainctl.workers.control.op_queue import QUEUED_SPAN, Handle

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 64)
BUSY_WINDOW_S = 60.0
OPERATION_SPANS = frozenset(k.value for k in OperationKind)


SAMPLE_SPAN = "sample"
"""The controller's span of one sample, from its arrival to its answer."""
SYNC_SPAN = "weight_sync"
"""The controller's span of one weight sync (``Samplers.sync``: after a step, or asked for)."""


def _window() -> tuple[list[spans.SpanRecord], float, float]:
    """This process's spans of the last ``BUSY_WINDOW_S``, read once, and the window."""
    until = spans.now()
    since = until - BUSY_WINDOW_S
    return spans.between(since, until), since, until


def _share(
    found: list[spans.SpanRecord], names: frozenset[str], since: float, until: float
) -> float:
    """The share of ``[since, until]`` covered by the spans of ``found`` named one of
    ``names`` (overlaps counted once)."""
    return spans.busy_share([s for s in found if s.name in names], since, until)


def _quantile(found: list[spans.SpanRecord], q: float) -> float:
    """The ``q`` quantile of the queue waits among ``found``: those of the operations that
    started in the window (0.0 when none did)."""
    waits = [s.end_s - s.start_s for s in found if s.name == QUEUED_SPAN]
    return float(np.quantile(waits, q)) if waits else 0.0


def share_now(names: frozenset[str]) -> float:
    """``_share`` of the spans named ``names`` over the last ``BUSY_WINDOW_S`` (a gauge)."""
    found, since, until = _window()
    return _share(found, names, since, until)


def queue_wait(q: float) -> float:
    """The ``q`` quantile of the queue waits over the last ``BUSY_WINDOW_S`` (a gauge)."""
    return _quantile(_window()[0], q)


def utilization() -> dict[str, float]:
    """Each component's busy share over the last ``BUSY_WINDOW_S``, from the controller's
    spans (read once): the trainer's (operations running), the samplers' (at least one
    sample in flight), the weight syncs', and the operation queue's wait (p50, p99)."""
    found, since, until = _window()
    return {
        "trainer_busy": _share(found, OPERATION_SPANS, since, until),
        "samplers_busy": _share(found, frozenset({SAMPLE_SPAN}), since, until),
        "sync_share": _share(found, frozenset({SYNC_SPAN}), since, until),
        "queue_wait_p50_s": _quantile(found, 0.5),
        "queue_wait_p99_s": _quantile(found, 0.99),
    }


class ControllerMetrics:
    """The controller's Prometheus metrics. Owns their registry and each metric."""

    def __init__(
        self, queue_depth: Callable[[], int], evicted: Callable[[], int] = lambda: 0
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("trainctl_steps", "Optimizer steps applied.", registry=r)
        self.tokens = Counter(
            "trainctl_tokens", "Tokens processed, by operation kind.", ["kind"], registry=r
        )
        self.computed_tokens = Counter(
            "trainctl_computed_tokens",
            "Tokens the model computed, by operation kind: fewer than trainctl_tokens where "
            "prefix tries shared them.",
            ["kind"],
            registry=r,
        )
        self.operations = Counter(
            "trainctl_operations",
            "Operations finished, by kind and status.",
            ["kind", "status"],
            registry=r,
        )
        self.errors = Counter(
            "trainctl_operation_errors", "Failed operations, by error type.", ["type"], registry=r
        )
        self.latency = Histogram(
            "trainctl_operation_seconds",
            "Operation run time (start to finish, excluding queueing), by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "trainctl_queue_wait_seconds",
            "Time operations waited in the queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.loss = Gauge(
            "trainctl_loss", "Loss of the latest step, by operation kind.", ["kind"], registry=r
        )
        self.grad_norm = Gauge(
            "trainctl_grad_norm", "Global gradient norm of the latest applied step.", registry=r
        )
        self.phases = Histogram(
            "trainctl_phase_seconds",
            "Time of each phase of a step (forward_backward, optimizer, ...), by kind.",
            ["kind", "phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.staleness = Histogram(
            "trainctl_staleness_steps",
            "Per sequence trained on (or evaluated) that carries its sampling steps: how many "
            "optimizer steps its oldest loss token's weights were behind the trainer's.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.recoveries = Counter(
            "trainctl_recoveries", "Rebuilds of the worker group after a failure.", registry=r
        )
        evictions = Gauge(
            "trainctl_controller_evictions",
            "Entries dropped from a bounded table of the controller since start, by table.",
            ["table"],
            registry=r,
        )
        evictions.labels("finished_operations").set_function(lambda: float(evicted()))
        window = f"the last {BUSY_WINDOW_S:.0f} s"
        for name, names, what in (
            ("trainctl_trainer_busy_ratio", OPERATION_SPANS, "the controller ran operations "
             "(the rest the trainer sat idle)"),
            ("trainctl_samplers_busy_ratio", {SAMPLE_SPAN}, "at least one sample was in "
             "flight on the sampler engines"),
            ("trainctl_sync_share_ratio", {SYNC_SPAN}, "the trainer spent sending weights "
             "to the samplers"),
        ):  # fmt: skip
            share = Gauge(name, f"Share of {window} {what} (from the controller's spans: "
                          "/v1/timeline).", registry=r)  # fmt: skip
            share.set_function(functools.partial(share_now, frozenset(names)))
        wait = Gauge(
            "trainctl_queue_wait_recent_seconds",
            f"Operations' wait in the queue before they ran, over {window}, by quantile.",
            ["quantile"],
            registry=r,
        )
        for q in (0.5, 0.99):
            wait.labels(str(q)).set_function(functools.partial(queue_wait, q))
        depth = Gauge("trainctl_queue_depth", "Operations waiting to run.", registry=r)
        depth.set_function(lambda: float(queue_depth()))
        self.sampler_lag = Gauge(
            "trainctl_sampler_lag_steps",
            "Optimizer steps the samplers are behind the trainer (0: they serve its weights).",
            registry=r,
        )
        self.sampler_restarts = Gauge(
            "trainctl_sampler_restarts",
            "Sampler engines recreated after dying, since start.",
            registry=r,
        )
        self.sync_seconds = Histogram(
            "trainctl_sampler_sync_seconds",
            "Weight syncs to the samplers, gather + load.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sample_seconds = Histogram(
            "trainctl_sample_seconds",
            "Sample requests, from the controller to the engine's answer.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sampled_tokens = Counter(
            "trainctl_sampled_tokens", "Tokens the samplers generated.", registry=r
        )

    def watch_samplers(self, lag: Callable[[], float], restarts: Callable[[], float]) -> None:
        self.sampler_lag.set_function(lag)
        self.sampler_restarts.set_function(restarts)

    def observe_staleness(self, per_sequence: np.ndarray) -> None:
        """One batch's staleness, a value per sequence (``staleness.py``)."""
        for value, count in zip(*np.unique(per_sequence, return_counts=True), strict=True):
            for _ in range(int(count)):
                self.staleness.observe(float(value))

    def observe(self, h: Handle) -> None:
        """Listener of the operation queue: called once per finished operation."""
        op = h.op
        kind = OperationKind(op.kind).value
        self.operations.labels(kind, op.status.value).inc()
        if op.started_at is not None and op.finished_at is not None:
            self.latency.labels(kind).observe(op.finished_at - op.started_at)
            self.queue_wait.observe(op.started_at - op.created_at)
        if op.status is OperationStatus.FAILED and op.error is not None:
            self.errors.labels(op.error.type.value).inc()
            return
        if OperationKind(op.kind) is OperationKind.RECOVER:
            self.recoveries.inc()
        if isinstance(op.result, StepResult):
            self.loss.labels(kind).set(op.result.loss)
            for name, seconds in op.result.timings.items():
                if name != "total_s":
                    self.phases.labels(kind, name.removesuffix("_s")).observe(seconds)
            if "grad_norm:value" in op.result.metrics:
                self.grad_norm.set(op.result.metrics["grad_norm:value"])
        if isinstance(op.result, StepResult | LogProbsResult):
            metrics = op.result.metrics
            self.tokens.labels(kind).inc(metrics.get("tokens:sum", 0.0))
            self.computed_tokens.labels(kind).inc(metrics.get("computed_tokens:sum", 0.0))
            if op.kind in (OperationKind.TRAIN_BATCH, OperationKind.OPTIM_STEP):
                self.steps.inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
