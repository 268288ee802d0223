"""Operations: every long call is queued and run one at a time, in arrival order.

Pure asyncio (no Ray, no torch), so the semantics are unit-tested directly:

* **Arrival order.** ``submit`` appends to one FIFO; a single worker task runs the head.
* **Bounded queue.** Past ``max_queued`` waiting operations, ``submit`` raises
  ``RateLimitedError`` (HTTP 429 with ``Retry-After``).
* **Idempotency.** An operation submitted with a key is remembered under it: a retry with the
  same key and the same request returns that operation (queued, running or finished) instead
  of a new one, so an optimizer step is never applied twice. The same key with a *different*
  request is a conflict. A failure that applied nothing and may pass later (429, 5xx) forgets
  the key, so the retry runs afresh; once an operation has changed the model
  (``Handle.applied``) its key is kept whatever follows, so a retry never applies it twice.
* **Bounded memory.** Finished operations are kept for polling up to ``keep_finished``,
  oldest dropped first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trainctl.api import (
    ConflictError,
    ErrorBody,
    ErrorType,
    NotFoundError,
    Operation,
    OperationKind,
    OperationStatus,
    RateLimitedError,
    TrainctlError,
)
from trainctl.workers import spans
from trainctl.workers.engine.boundary import OpRef
from trainctl.workers.rank.logs import current_operation

log = logging.getLogger(__name__)


T = TypeVar("T")
Runs = Callable[["Handle"], Awaitable[T]]
"""What an operation runs in its turn, typed by its result."""
Runner = Runs[Any]
QUEUED_SPAN = "queued"
"""An operation's wait in the queue, recorded when it starts."""


@dataclass(eq=False)
class Handle:
    """One operation's mutable state; ``snapshot()`` is its API view."""

    op: Operation
    run: Runner | None
    """What runs it; dropped once it finished, with the request and plan it holds."""
    key: str | None
    fingerprint: str
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    exc: TrainctlError | None = None
    applied: bool = False
    """Set by the runner once the model changed (a step applied): from then on the key is
    kept, so a retry gets this operation, never a second step."""
    phase_span: spans.Open | None = None
    """The span of the phase it is in (``set_phase``), a child of the operation's."""
    trace: str | None = None
    """The caller's ``traceparent``: the operation's span is its child. While it runs, its own
    span's (what its rank calls carry: ``ref``)."""
    adapter: str | None = None
    """The adapter it works on (None: the base, or none)."""

    def ref(self) -> OpRef:
        """The operation as a rank call carries it: its id and the trace its spans join."""
        return OpRef(self.op.id, self.trace)

    def set_phase(self, phase: str) -> None:
        self.op.phase = phase
        log.info("phase: %s", phase)
        self.end_phase()
        self.phase_span = spans.start(phase, op=self.op.id)

    def end_phase(self) -> None:
        if self.phase_span is not None:
            self.phase_span.end()
            self.phase_span = None


class OperationQueue:
    """The operation queue. Owns the pending and running operations, the finished ones kept for
    polling, the idempotency keys and the one worker task that runs them in order."""

    def __init__(
        self, *, max_queued: int = 64, keep_finished: int = 1024, avg_run_s: float = 1.0
    ) -> None:
        self.max_queued = max_queued
        self.keep_finished = keep_finished
        self._pending: deque[Handle] = deque()
        self._running: Handle | None = None
        self._ops: OrderedDict[str, Handle] = OrderedDict()
        self._by_key: dict[str, Handle] = {}
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._seq = itertools.count(1)
        self._avg_run_s = avg_run_s
        self.evicted = 0
        """Finished operations dropped (with their keys) to keep ``keep_finished``."""
        self.listeners: list[Callable[[Handle], None]] = []
        """Called with every finished operation (metrics)."""

    # -- submitting and waiting ------------------------------------------------------------

    def find(self, kind: OperationKind, key: str | None, fingerprint: str) -> Operation | None:
        """The operation submitted under ``key``, if any; a conflict if it was another request."""
        h = self._by_key.get(key) if key is not None else None
        if h is None:
            return None
        if h.fingerprint != fingerprint or h.op.kind != kind:
            raise ConflictError(
                f"idempotency key {key!r} was already used for a different {h.op.kind} request",
                details={"operation": h.op.id},
            )
        log.info("idempotent retry of %s %s", h.op.kind, h.op.id)
        return self.snapshot(h)

    def submit(
        self,
        kind: OperationKind,
        run: Runner,
        *,
        key: str | None = None,
        fingerprint: str = "",
        front: bool = False,
        trace: str | None = None,
        adapter: str | None = None,
    ) -> Operation:
        """Queue ``run`` (or find the operation already submitted under ``key``); ``front``
        puts it ahead of everything queued (failure recovery), past the queue limit;
        ``trace``: the caller's ``traceparent``, which the operation's spans join;
        ``adapter``: the adapter it works on, which its span names."""
        existing = self.find(kind, key, fingerprint)
        if existing is not None:
            return existing
        if len(self._pending) >= self.max_queued and not front:
            raise RateLimitedError(
                f"{len(self._pending)} operations are queued (limit {self.max_queued}); "
                "retry after the Retry-After seconds",
                details={"queued": len(self._pending)},
                retry_after_s=max(1.0, round(self._avg_run_s * len(self._pending) / 4, 1)),
            )
        op_id = f"op-{next(self._seq):06d}-{uuid.uuid4().hex[:8]}"
        op = Operation(
            id=op_id,
            kind=OperationKind(kind),
            status=OperationStatus.QUEUED,
            created_at=time.time(),
            trace_id=spans.trace_id_of(trace),
        )
        h = Handle(op=op, run=run, key=key, fingerprint=fingerprint, trace=trace, adapter=adapter)
        self._ops[op_id] = h
        if key is not None:
            self._by_key[key] = h
        if front:
            self._pending.appendleft(h)
        else:
            self._pending.append(h)
        self._ensure_worker()
        self._wake.set()
        return self.snapshot(h)

    async def wait(self, op_id: str, timeout: float | None = None) -> Operation:
        """The operation once finished, or as it is after ``timeout`` seconds."""
        h = self._handle(op_id)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(h.finished.wait(), timeout)
        return self.snapshot(h)

    async def result(self, op_id: str) -> Any:
        """Wait for the operation; its result, or its error raised."""
        h = self._handle(op_id)
        await h.finished.wait()
        if h.exc is not None:
            raise h.exc
        return h.op.result

    def get(self, op_id: str) -> Operation:
        return self.snapshot(self._handle(op_id))

    def _handle(self, op_id: str) -> Handle:
        h = self._ops.get(op_id)
        if h is None:
            raise NotFoundError(
                f"operation {op_id!r} is unknown (or finished long ago and was dropped)"
            )
        return h

    def snapshot(self, h: Handle) -> Operation:
        op = h.op.model_copy()
        if op.status is OperationStatus.QUEUED:
            ahead = next(i for i, p in enumerate(self._pending) if p is h)
            op.queue_position = ahead + (self._running is not None)
        return op

    @property
    def depth(self) -> int:
        """Operations waiting (not counting the one running)."""
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return self._running is not None or bool(self._pending)

    async def idle(self) -> None:
        """Return once nothing is queued or running."""
        while self.busy:
            h = self._running or self._pending[-1]
            await h.finished.wait()

    def fail_pending(self, error: TrainctlError) -> int:
        """Fail every queued (not running) operation with ``error``; returns how many."""
        n = 0
        while self._pending:
            self._finish(self._pending.popleft(), exc=error)
            n += 1
        return n

    # -- the worker -------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            h = self._pending.popleft()
            self._running = h
            h.op.status, h.op.started_at = OperationStatus.RUNNING, time.time()
            token = current_operation.set(h.op.id)
            try:
                log.info("%s started", h.op.kind)
                assert h.run is not None
                with spans.span(
                    h.op.kind.value, parent=h.trace, op=h.op.id, adapter=h.adapter
                ) as current:
                    queued = (h.op.created_at, h.op.started_at)
                    spans.record(QUEUED_SPAN, *queued, op=h.op.id)
                    h.trace = spans.traceparent()
                    h.op.trace_id = spans.trace_id_of(h.trace) or h.op.trace_id
                    try:
                        result = await h.run(h)
                    finally:
                        h.end_phase()
                    if isinstance(step := getattr(result, "step", None), int):
                        current.set_attribute("step", step)  # the step it ran at, or made
            except TrainctlError as e:
                self._finish(h, exc=e)
            except Exception as e:  # a bug, not the caller's fault: keep serving
                log.exception("%s failed unexpectedly", h.op.kind)
                self._finish(h, exc=TrainctlError(f"{type(e).__name__}: {e}"))
            else:
                self._finish(h, result=result)
            finally:
                current_operation.reset(token)
                self._running = None

    def _finish(self, h: Handle, *, result: Any = None, exc: TrainctlError | None = None) -> None:
        op = h.op
        h.run = None  # the request and its plan: only the result is kept for polling
        op.finished_at, op.phase = time.time(), None
        if exc is None:
            op.status, op.result = OperationStatus.DONE, result
            if op.started_at is not None:
                self._avg_run_s = 0.8 * self._avg_run_s + 0.2 * (op.finished_at - op.started_at)
        else:
            # Kept to raise again for waiters; without its frames, which hold the request.
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            op.status, h.exc = OperationStatus.FAILED, exc
            op.error = ErrorBody(type=exc.type, message=exc.message, details=exc.details)
            if exc.retryable and not h.applied and h.key is not None:
                self._by_key.pop(h.key, None)  # nothing applied: a retry may run afresh
            level = logging.ERROR if exc.type is ErrorType.INTERNAL else logging.WARNING
            log.log(level, "%s %s failed: %s", op.kind, op.id, exc.message)
        h.finished.set()
        for listener in self.listeners:
            listener(h)
        self._evict()

    def _evict(self) -> None:
        finished = [k for k, h in self._ops.items() if h.finished.is_set()]
        for op_id in finished[: max(0, len(finished) - self.keep_finished)]:
            h = self._ops.pop(op_id)
            self.evicted += 1
            if h.key is not None and self._by_key.get(h.key) is h:
                del self._by_key[h.key]


class Operations:
    """The operations API over a queue: ``submit``, ``run`` and ``operation``. ``prepare`` validates
    and plans a request *before* it is queued (so a rejected request never queues) and returns its
    runner; ``check`` raises ``NotReadyError`` when no new work is taken. Owns nothing but its queue
    and the two callbacks it is given."""

    def __init__(
        self,
        queue: OperationQueue,
        prepare: Callable[[OperationKind, Any], Awaitable[Runner]],
        check: Callable[[], None],
    ) -> None:
        self.queue, self.prepare, self.check = queue, prepare, check

    async def submit(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Operation:
        """Queue an operation, or return the one already submitted under ``key``; ``trace``:
        the caller's ``traceparent`` (else the current span's, in this process)."""
        self.check()
        existing = self.queue.find(kind, key, fingerprint)
        if existing is not None:
            return existing
        trace = trace or spans.traceparent()
        with spans.span("prepare", parent=trace, kind=OperationKind(kind).value):  # checks, a plan
            run = await self.prepare(kind, req)
        adapter = getattr(req, "adapter", None)
        return self.queue.submit(
            kind, run, key=key, fingerprint=fingerprint, trace=trace,
            adapter=adapter if isinstance(adapter, str) else None,
        )  # fmt: skip

    async def run(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Any:
        """``submit`` and wait: the operation's result, or its error raised."""
        op = await self.submit(kind, req, key, fingerprint, trace)
        return await self.queue.result(op.id)

    async def operation(self, op_id: str, wait_s: float = 0.0) -> Operation:
        """The operation's state; with ``wait_s``, once finished or after that many seconds."""
        if wait_s > 0:
            return await self.queue.wait(op_id, timeout=wait_s)
        return self.queue.get(op_id)
