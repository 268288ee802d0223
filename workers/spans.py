"""Spans of the work each process does, kept in a bounded ring and exported on demand.

Every process of the service (the gateway, the controller, each rank, each sampler engine)
records its spans through OpenTelemetry's SDK: one tracer provider per process
(``install``), whose ``RingProcessor`` keeps the finished spans in a ``SpanRing`` of at most
``size`` (a full ring drops the oldest and counts them), and which may also export them over
OTLP. A ``size`` of 0 turns tracing off in that process: no provider is installed, and every
span is OpenTelemetry's no-op one. The
timeline (``GET /v1/timeline``) gathers the rings' spans in a time range and writes them as
Chrome trace JSON (``chrome_trace``), which Perfetto's UI opens: one row per process.

Each process names its row once (``install(row=...)``: ``gateway``, ``controller``,
``rank 3``, ``engine 0``). A span's times are this process's wall clock (``time.time``); the
collector shifts each process's spans by that process's clock offset (``clock_offset``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Attr = str | int | float | bool
RING_SPANS = 20_000
"""The spans a process keeps by default (about 10 MB of host memory at most)."""
TRACER = "trainctl"


@dataclass(frozen=True)
class SpanRecord:
    """One finished span as the timeline shows it."""

    name: str
    start_s: float
    """Start, in seconds of this process's wall clock (Unix time)."""
    end_s: float
    row: str
    """The timeline row of the process that recorded it."""
    trace_id: str
    """32 hex digits: the trace it belongs to (one client call, or one background task)."""
    span_id: str
    parent_id: str | None
    attrs: Mapping[str, Attr]


class SpanRing:
    """The recent spans of one process. Owns at most ``size`` of them, oldest first, and the
    count of spans dropped to stay within that."""

    def __init__(self, size: int = RING_SPANS) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size}")
        self._spans: deque[SpanRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.dropped = 0
        """Spans dropped, oldest first, because the ring was full."""

    @property
    def size(self) -> int:
        return self._spans.maxlen or 0

    def __len__(self) -> int:
        return len(self._spans)

    def add(self, span: SpanRecord) -> None:
        with self._lock:
            if len(self._spans) == self.size:
                self.dropped += 1
            self._spans.append(span)

    def between(self, since: float, until: float) -> list[SpanRecord]:
        """The spans that overlap ``[since, until]`` (seconds of this process's clock)."""
        with self._lock:
            return [s for s in self._spans if s.end_s >= since and s.start_s <= until]

    def oldest(self) -> float | None:
        """When the oldest span kept started; None when there is none."""
        with self._lock:
            return self._spans[0].start_s if self._spans else None


def _hex(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


def _attrs(span: ReadableSpan) -> dict[str, Attr]:
    out: dict[str, Attr] = {}
    for key, value in (span.attributes or {}).items():
        if isinstance(value, str | int | float | bool):
            out[key] = value
    return out


class RingProcessor(SpanProcessor):
    """OpenTelemetry's hook at the end of every span: the span, as a ``SpanRecord`` of this
    process's row, into the ring. Owns nothing but its references to them."""

    def __init__(self, ring: SpanRing, row: str) -> None:
        self.ring = ring
        self.row = row

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        if ctx is None or span.start_time is None or span.end_time is None:
            return
        parent = span.parent
        self.ring.add(
            SpanRecord(
                name=span.name,
                start_s=span.start_time / 1e9,
                end_s=span.end_time / 1e9,
                row=self.row,
                trace_id=_hex(ctx.trace_id, 32),
                span_id=_hex(ctx.span_id, 16),
                parent_id=_hex(parent.span_id, 16) if parent is not None else None,
                attrs=_attrs(span),
            )
        )


@dataclass
class Tracing:
    """A tracer provider and the ring its spans go into."""

    provider: TracerProvider
    ring: SpanRing
    processor: RingProcessor


_installed: list[Tracing] = []
"""This process's tracer provider, once ``install`` made it."""
_decided: list[bool] = []
"""Set by the first ``install``: whether this process traces is decided once."""


def install(
    row: str, *, size: int = RING_SPANS, otlp_endpoint: str | None = None
) -> SpanRing | None:
    """This process's tracer provider, made once: its spans go into a ring of ``size`` (and,
    with ``otlp_endpoint``, to that OTLP/HTTP receiver too); ``size`` 0: none (tracing off).
    A second call renames the row and returns the same ring."""
    if _installed:
        _installed[0].processor.row = row
        return _installed[0].ring
    off = bool(_decided) or size == 0  # decided off before, or now
    _decided.append(True)
    if off:
        return None
    made = make_provider(row, size=size, otlp_endpoint=otlp_endpoint)
    trace.set_tracer_provider(made.provider)
    _installed.append(made)
    return made.ring


def installed() -> bool:
    """Whether ``install`` was called in this process (with tracing on or off)."""
    return bool(_decided)


def make_provider(row: str, *, size: int, otlp_endpoint: str | None) -> Tracing:
    """A tracer provider whose spans go into a new ring of ``size`` as ``row``'s and, with
    ``otlp_endpoint`` (``http://HOST:4318``), to that OTLP/HTTP receiver's ``/v1/traces`` in
    batches; its resource names the service ``trainctl`` and the row (``trainctl.row``)."""
    ring = SpanRing(size)
    processor = RingProcessor(ring, row)
    resource = Resource.create({"service.name": "trainctl", "trainctl.row": row})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, ring, processor)


ENV = ("TRAINCTL_TRACE_SPANS", "TRAINCTL_OTLP_ENDPOINT")
"""The variables that carry the service's tracing settings to every process it starts."""


def install_from_env(row: str) -> SpanRing | None:
    """``install`` with the service's settings as the launch hands them to every process
    (``ENV``)."""
    size = int(os.environ.get("TRAINCTL_TRACE_SPANS") or RING_SPANS)
    return install(row, size=size, otlp_endpoint=os.environ.get("TRAINCTL_OTLP_ENDPOINT") or None)


def env() -> dict[str, str]:
    """This process's tracing settings (``ENV``), for a process it starts."""
    return {k: os.environ[k] for k in ENV if k in os.environ}


def ring() -> SpanRing | None:
    """This process's ring; None until ``install``."""
    return _installed[0].ring if _installed else None


def dropped() -> int:
    """The spans this process's ring dropped so far (0 without one)."""
    kept = ring()
    return kept.dropped if kept is not None else 0


def flush() -> None:
    """Hand every finished span to the exporters now (a test, or before the process ends)."""
    if _installed:
        _installed[0].provider.force_flush()


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent`` header value (None outside a recorded span):
    what a call to another process carries so that its spans join this trace."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def trace_id_of(parent: str | None) -> str | None:
    """The trace id (32 hex digits) of a ``traceparent`` value; None if it is not a valid one."""
    ctx = trace.get_current_span(_context(parent)).get_span_context()
    return _hex(ctx.trace_id, 32) if ctx.is_valid else None


def _context(parent: str | None) -> Context | None:
    if not parent:
        return None
    return TraceContextTextMapPropagator().extract({"traceparent": parent})


@contextlib.contextmanager
def span(name: str, parent: str | None = None, **attrs: Attr | None) -> Iterator[trace.Span]:
    """A span around the block: a child of ``parent`` (a ``traceparent`` from another process)
    if given, else of the current span; attributes that are None are left out. Without
    ``install`` the span is OpenTelemetry's no-op one."""
    tracer = trace.get_tracer(TRACER)
    given = {k: v for k, v in attrs.items() if v is not None}
    with tracer.start_as_current_span(name, context=_context(parent), attributes=given) as current:
        yield current


@dataclass
class Timed:
    """The times of a ``timed`` block, in seconds of this process's wall clock."""

    start_s: float
    end_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The block's length: the span's, exactly (0.0 while it runs)."""
        return max(self.end_s - self.start_s, 0.0)


@contextlib.contextmanager
def timed(name: str, **attrs: Attr | None) -> Iterator[Timed]:
    """A span around the block, a child of the current one, whose times are measured once:
    a timing reported from ``Timed.seconds`` is the span's length, never a second clock's."""
    t = Timed(now())
    given = {k: v for k, v in attrs.items() if v is not None}
    tracer = trace.get_tracer(TRACER)
    start = int(t.start_s * 1e9)
    with tracer.start_as_current_span(
        name, attributes=given, start_time=start, end_on_exit=False
    ) as current:
        try:
            yield t
        finally:
            t.end_s = now()
            current.end(end_time=int(t.end_s * 1e9))


Open = trace.Span
"""A span started with ``start``: its holder ends it (``.end()``)."""


def start(name: str, **attrs: Attr | None) -> Open:
    """A span that outlives a block (a phase, ended when the next begins), a child of the
    current one; its holder ends it."""
    given = {k: v for k, v in attrs.items() if v is not None}
    return trace.get_tracer(TRACER).start_span(name, attributes=given)


def record(name: str, start_s: float, end_s: float, **attrs: Attr | None) -> None:
    """A span of work that already happened (a request's wait in a queue), from its times in
    seconds of this process's clock."""
    given = {k: v for k, v in attrs.items() if v is not None}
    s = trace.get_tracer(TRACER).start_span(name, attributes=given, start_time=int(start_s * 1e9))
    s.end(end_time=int(end_s * 1e9))


def between(since: float, until: float, offset_s: float = 0.0) -> list[SpanRecord]:
    """This process's spans overlapping ``[since, until]`` on the collector's clock, whose
    clock runs ``offset_s`` seconds ahead of this process's, shifted onto that clock."""
    kept = ring()
    if kept is None:
        return []
    local = kept.between(since - offset_s, until - offset_s)
    if offset_s == 0.0:
        return local
    return [shifted(s, offset_s) for s in local]


Found = tuple[list[SpanRecord], int]
"""Spans read from a process, and the count its ring dropped."""


def recent(since: float, until: float, offset_s: float) -> Found:
    """What a process answers a collector's read: ``between``, and the spans its ring
    dropped so far."""
    return between(since, until, offset_s), dropped()


def shifted(s: SpanRecord, offset_s: float) -> SpanRecord:
    """``s`` moved ``offset_s`` seconds later (onto a clock that runs that far ahead)."""
    return SpanRecord(
        s.name, s.start_s + offset_s, s.end_s + offset_s, s.row, s.trace_id, s.span_id,
        s.parent_id, s.attrs,
    )  # fmt: skip


def clock_offset(remote_now: float, sent: float, received: float) -> float:
    """How far the collector's clock runs ahead of a process that answered ``remote_now``
    to a call sent at ``sent`` and answered at ``received`` (the collector's clock): the
    midpoint of the round trip, as NTP takes it."""
    return (sent + received) / 2 - remote_now


def now() -> float:
    """This process's wall clock, for ``clock_offset``."""
    return time.time()


def busy_share(found: list[SpanRecord], since: float, until: float) -> float:
    """The share of ``[since, until]`` that the spans ``found`` cover (overlaps counted once):
    how busy a process was, from its spans of work."""
    if until <= since:
        return 0.0
    covered, reach = 0.0, since
    for s in sorted(found, key=lambda s: s.start_s):
        start, end = max(s.start_s, reach), min(s.end_s, until)
        if end > start:
            covered += end - start
            reach = end
    return covered / (until - since)


_ROW_ORDER = ("gateway", "controller", "rank", "engine")


def _row_key(row: str) -> tuple[int, int, str]:
    kind, _, number = row.partition(" ")
    order = _ROW_ORDER.index(kind) if kind in _ROW_ORDER else len(_ROW_ORDER)
    return order, int(number) if number.isdigit() else 0, row


def chrome_trace(spans: list[SpanRecord], *, dropped: int = 0) -> dict[str, Any]:
    """The spans as Chrome trace JSON (Perfetto's UI and ``chrome://tracing`` open it): one
    process row per ``row``, in the order gateway, controller, ranks, engines; each span a
    complete event (``ph: X``) in microseconds, its attributes and trace ids as ``args``.
    Spans of one row that overlap without nesting (two requests at once) go on separate
    threads of the row, so that every thread's events nest."""
    rows = sorted({s.row for s in spans}, key=_row_key)
    pid = {row: i + 1 for i, row in enumerate(rows)}
    events: list[dict[str, Any]] = []
    for row in rows:
        events.append({"name": "process_name", "ph": "M", "pid": pid[row], "tid": 0,
                       "args": {"name": row}})  # fmt: skip
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid[row], "tid": 0,
                       "args": {"sort_index": pid[row]}})  # fmt: skip
    for row in rows:
        lanes: list[list[SpanRecord]] = []  # each lane: a stack of open spans
        for s in sorted((s for s in spans if s.row == row), key=lambda s: (s.start_s, -s.end_s)):
            tid = _lane(lanes, s)
            args: dict[str, Any] = {"trace_id": s.trace_id, "span_id": s.span_id, **s.attrs}
            if s.parent_id is not None:
                args["parent_id"] = s.parent_id
            events.append({
                "name": s.name, "ph": "X", "pid": pid[row], "tid": tid,
                "ts": round(s.start_s * 1e6, 3), "dur": round((s.end_s - s.start_s) * 1e6, 3),
                "args": args,
            })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"spans": len(spans), "dropped": dropped}}  # fmt: skip


def _lane(lanes: list[list[SpanRecord]], s: SpanRecord) -> int:
    """The first lane where ``s`` nests in the open span (or starts after it ended)."""
    for i, stack in enumerate(lanes):
        while stack and stack[-1].end_s <= s.start_s:
            stack.pop()
        if not stack or stack[-1].end_s >= s.end_s:
            stack.append(s)
            return i + 1
    lanes.append([s])
    return len(lanes)
