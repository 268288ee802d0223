"""The spans behind the timeline (``workers/spans.py``) and ``GET /v1/timeline`` with a fake
controller: the ring's bound, OpenTelemetry's spans as the ring keeps them, the Chrome trace
Perfetto opens, clock offsets, and bad ranges refused naming the field."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider

from trainctl.workers import spans
from trainctl.workers.spans import SpanRecord, SpanRing

from helpers.fakes import FakeController
from helpers.otlp import receiving


def _record(i: int, start: float = 0.0, end: float = 1.0, row: str = "rank 0") -> SpanRecord:
    return SpanRecord(f"s{i}", start, end, row, "0" * 32, format(i, "016x"), None, {"i": i})


def test_a_full_ring_keeps_its_bound_drops_the_oldest_and_counts_them() -> None:
    ring = SpanRing(1000)
    for i in range(100_000):
        ring.add(_record(i, start=float(i), end=float(i) + 0.5))
    assert len(ring) == 1000 and ring.dropped == 99_000
    kept = ring.between(0.0, 1e9)
    assert [s.name for s in (kept[0], kept[-1])] == ["s99000", "s99999"]
    # Its memory is that of the spans it keeps: the deque holds no more than its bound.
    assert sys.getsizeof(ring._spans) < 64 * 1024


def test_opentelemetry_spans_reach_the_ring_nested_with_their_attributes() -> None:
    ring = SpanRing(100)
    provider = TracerProvider()  # a provider of the test's own: the process's stays as it is
    provider.add_span_processor(spans.RingProcessor(ring, "rank 1"))
    tracer = provider.get_tracer("test")
    t0 = time.time()
    outer_span = tracer.start_as_current_span("accumulate", attributes={"op": "op-1"})
    with outer_span as outer, tracer.start_as_current_span("forward"):
        time.sleep(0.01)
    got = {s.name: s for s in ring.between(t0 - 1, time.time() + 1)}
    assert set(got) == {"accumulate", "forward"}
    a, f = got["accumulate"], got["forward"]
    assert a.row == f.row == "rank 1" and a.attrs == {"op": "op-1"}
    assert f.parent_id == a.span_id and a.parent_id is None and f.trace_id == a.trace_id
    assert a.trace_id == format(outer.get_span_context().trace_id, "032x")
    assert a.start_s <= f.start_s and f.end_s <= a.end_s and f.end_s - f.start_s >= 0.01


def test_the_chrome_trace_has_a_row_per_process_and_overlapping_spans_on_lanes() -> None:
    recs = [
        _record(1, 0.0, 4.0, "rank 1"),
        _record(2, 1.0, 2.0, "rank 1"),  # nested in 1: the same lane
        _record(3, 3.0, 6.0, "rank 1"),  # overlaps 1 without nesting: a second lane
        _record(4, 0.5, 1.0, "gateway"),
        _record(5, 0.0, 1.0, "controller"),
        _record(6, 0.0, 1.0, "rank 0"),
    ]
    trace = spans.chrome_trace(recs, dropped=3)
    meta = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    names = {e["pid"]: e["args"]["name"] for e in meta}
    assert [names[p] for p in sorted(names)] == ["gateway", "controller", "rank 0", "rank 1"]
    x = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert x["s1"]["tid"] == x["s2"]["tid"] != x["s3"]["tid"]
    assert x["s3"]["ts"] == 3e6 and x["s3"]["dur"] == 3e6 and x["s3"]["args"]["i"] == 3
    assert trace["otherData"] == {"spans": 6, "dropped": 3}


def test_a_clock_offset_is_the_round_trips_midpoint_and_shifts_the_spans() -> None:
    # sent at 10.0, answered 10.2 on the collector's clock; the remote said 110.1: it runs
    # 100 s ahead, so its spans move 100 s earlier.
    offset = spans.clock_offset(110.1, 10.0, 10.2)
    assert offset == pytest.approx(-100.0)
    moved = spans.shifted(_record(1, 110.0, 111.0), offset)
    assert (moved.start_s, moved.end_s) == pytest.approx((10.0, 11.0))


def test_a_ring_refuses_a_size_below_one() -> None:
    with pytest.raises(ValueError, match="size must be at least 1"):
        SpanRing(0)


# -- GET /v1/timeline ---------------------------------------------------------------------------


def test_the_timeline_holds_the_gateways_and_the_controllers_spans_on_one_clock(
    http: TestClient, fake: FakeController
) -> None:
    fake.clock_ahead_s = 100.0  # the controller's clock runs 100 s ahead of the gateway's
    now = time.time()
    fake.remote_spans = [_record(7, now + 100.0 - 2.0, now + 100.0 - 1.0, "controller")]
    fake.remote_dropped = 5
    r = http.post("/v1/train_batch", json={"sequences": [{"tokens": [1, 2, 3]}]})
    assert r.status_code == 200, r.text
    trace = http.get("/v1/timeline", params={"since": now - 30, "until": time.time() + 1})
    assert trace.status_code == 200, trace.text
    events = [e for e in trace.json()["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    # The gateway's request, and the operation the (fake) controller ran in this process
    # with its queue wait and phases.
    assert {"POST /v1/train_batch", "train_batch", "queued"} <= names, names
    remote = next(e for e in events if e["name"] == "s7")
    assert remote["ts"] / 1e6 == pytest.approx(now - 2.0, abs=0.5)  # moved onto our clock
    asked = fake.timeline_asked
    assert asked is not None and asked[0] == pytest.approx(now - 30 + 100.0, abs=0.5)
    assert trace.json()["otherData"]["dropped"] >= 5


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": 20.0, "until": 10.0}, "since"),
        ({"format": "pftrace"}, "format"),
        ({"since": 1.0, "until": 2.0}, "until"),  # 1970: long before the oldest span kept
        ({"since": "yesterday"}, "since"),
    ],
)
def test_a_bad_range_or_format_is_a_422_naming_the_field(
    http: TestClient, params: dict[str, object], field: str
) -> None:
    http.get("/v1/health")  # a span in the ring
    r = http.get("/v1/timeline", params=params)
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith(f"{field}"), r.json()


def test_only_the_operator_reads_the_timeline(tmp_path: Path) -> None:
    """A tenant's key is refused on ``/v1/timeline`` (403: it reaches the Tinker API only),
    a missing token is a 401, and the operator's token reads it."""
    from trainctl.service.app import create_app

    keys = tmp_path / "keys"
    keys.write_text("acme acme-key-0123456789abcdef\n")
    app = create_app(FakeController(), api_token="operator-token", api_keys_file=str(keys))
    with TestClient(app) as http:
        tenant = http.get(
            "/v1/timeline", headers={"Authorization": "Bearer acme-key-0123456789abcdef"}
        )
        assert tenant.status_code == 403, tenant.text
        assert http.get("/v1/timeline").status_code == 401
        ok = http.get("/v1/timeline", headers={"Authorization": "Bearer operator-token"})
        assert ok.status_code == 200 and "traceEvents" in ok.json(), ok.text


def test_spans_reach_an_otlp_receiver_with_their_service_row_and_attributes() -> None:
    """The OTLP/HTTP exporter ``--otlp-endpoint`` adds, against a receiver in this test that
    decodes what it is sent as the OpenTelemetry collector would."""
    with receiving() as receiver:
        made = spans.make_provider("rank 2", size=10, otlp_endpoint=receiver.url)
        tracer = made.provider.get_tracer("test")
        with tracer.start_as_current_span("accumulate", attributes={"op": "op-7"}):
            pass
        made.provider.force_flush()
        made.provider.shutdown()
        [sent] = receiver.received()
    assert sent.service == "trainctl" and sent.row == "rank 2"
    assert sent.name == "accumulate" and sent.attrs == {"op": "op-7"}
    assert len(made.ring) == 1  # and the ring has it too


def test_busy_share_counts_each_covered_second_once() -> None:
    found = [_record(1, 0.0, 4.0), _record(2, 2.0, 6.0), _record(3, 8.0, 9.0), _record(4, -5, 1)]
    assert spans.busy_share(found, 0.0, 10.0) == pytest.approx(0.7)  # [0, 6] and [8, 9]
    assert spans.busy_share([], 0.0, 10.0) == 0.0 and spans.busy_share(found, 5.0, 5.0) == 0.0


def test_the_trainers_busy_share_is_a_gauge_from_the_controllers_spans() -> None:
    from trainctl.workers.control.telemetry import BUSY_WINDOW_S, ControllerMetrics

    spans.install("controller")  # this process's ring (another test may have made it)
    now = time.time()
    spans.record("train_batch", now - BUSY_WINDOW_S / 2, now, op="op-busy")
    spans.record("not_an_operation", now - BUSY_WINDOW_S, now)  # not the trainer's work
    text = ControllerMetrics(queue_depth=lambda: 0).text().decode()
    [line] = [x for x in text.splitlines() if x.startswith("trainctl_trainer_busy_ratio ")]
    assert 0.5 <= float(line.split()[1]) < 0.6, line


def test_a_callers_traceparent_is_the_trace_of_its_request_and_its_operation(
    http: TestClient,
) -> None:
    """The W3C header the SDK sends: the gateway's span and the operation's spans (run here
    by the fake controller's real queue) join the caller's trace."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace_id}-00f067aa0ba902b7-01"
    t0 = time.time()
    r = http.post(
        "/v1/train_batch", json={"sequences": [{"tokens": [1, 2, 3]}]},
        headers={"traceparent": parent},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    events = [e for e in http.get("/v1/timeline", params={"since": t0 - 1}).json()["traceEvents"]
              if e["ph"] == "X" and e["args"]["trace_id"] == trace_id]  # fmt: skip
    names = {e["name"] for e in events}
    assert {"POST /v1/train_batch", "train_batch", "queued"} <= names, names
    request = next(e for e in events if e["name"] == "POST /v1/train_batch")
    assert request["args"]["parent_id"] == "00f067aa0ba902b7"  # the caller's span


def test_the_sdk_sends_one_traceparent_per_call_and_keeps_its_trace_id() -> None:
    import httpx

    from trainctl.clients import TrainctlClient

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["traceparent"])
        return httpx.Response(200, json={"status": "ok", "service": "trainctl"})

    http = httpx.Client(base_url="http://x", transport=httpx.MockTransport(answer))
    with TrainctlClient("http://x", http_client=http) as tc:
        tc.health()
        first = tc.last_trace_id
        tc.health()
    assert len(seen) == 2 and seen[0] != seen[1]
    assert first is not None and seen[0] == f"00-{first}-{seen[0][36:52]}-01"
    assert spans.trace_id_of(seen[1]) == tc.last_trace_id


def test_an_otlp_endpoint_without_the_exporter_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from pydantic import ValidationError

    from trainctl.service.settings import Settings

    assert Settings(otlp_endpoint="http://127.0.0.1:4318").otlp_endpoint  # installed here
    real = importlib.util.find_spec

    def without(name: str, *args: object) -> object:
        if name.startswith("opentelemetry.exporter.otlp"):
            return None
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without)
    with pytest.raises(
        ValidationError, match=r"otlp_endpoint: .*pip install 'trainctl\[tracing\]'"
    ):
        Settings(otlp_endpoint="http://127.0.0.1:4318")
    assert Settings().otlp_endpoint is None  # no endpoint: nothing to check


def test_a_ring_of_size_zero_turns_tracing_off_in_that_process() -> None:
    """``--trace-spans 0``: no provider is installed, spans are OpenTelemetry's no-op ones,
    and nothing is kept (in a process of its own: a process decides once)."""
    import subprocess

    code = (
        "from trainctl.workers import spans\n"
        "assert spans.install('rank 0', size=0) is None\n"
        "with spans.span('forward', op='op-1') as s:\n"
        "    assert not s.get_span_context().is_valid\n"
        "    assert spans.traceparent() is None\n"
        "spans.record('optimizer', 1.0, 2.0)\n"
        "assert spans.ring() is None and spans.installed() and spans.dropped() == 0\n"
        "assert spans.install('rank 0', size=10) is None  # decided once\n"
        "assert spans.recent(0.0, 1e12, 0.0) == ([], 0)\n"
        "print('off')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "off", done.stderr


# -- Tinker's session trace ---------------------------------------------------------------------

_TRACE_A, _TRACE_B = "a" * 32, "b" * 32


def _parent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{'1' * 16}-01"}


def test_a_session_trace_holds_its_own_calls_spans_and_none_of_another_tenants(
    tmp_path: Path,
) -> None:
    """Tinker's ``export_session_trace`` polls ``trace_export`` and downloads the URL it
    answers without credentials: the trace holds the spans, on every process, of the traces
    the session's calls made, and nothing of another tenant's session; another tenant asking
    for the session gets a 404, as everywhere."""
    from trainctl.service.app import create_app

    keys = tmp_path / "keys"
    keys.write_text("acme acme-key-0123456789abcdef\nzeta zeta-key-0123456789abcdef\n")
    fake = FakeController()
    app = create_app(fake, api_token="operator-token", api_keys_file=str(keys))
    acme = {"X-API-Key": "tml-acme-key-0123456789abcdef"}
    zeta = {"X-API-Key": "tml-zeta-key-0123456789abcdef"}
    with TestClient(app) as http:
        sessions = {}
        for name, key, trace_id in (("acme", acme, _TRACE_A), ("zeta", zeta, _TRACE_B)):
            made = http.post("/api/v1/create_session", json={}, headers=key)
            assert made.status_code == 200, made.text
            sessions[name] = made.json()["session_id"]
            beat = http.post(
                "/api/v1/session_heartbeat",
                json={"session_id": sessions[name]},
                headers={**key, **_parent(trace_id)},
            )
            assert beat.status_code == 200, beat.text
        now = time.time()
        fake.remote_spans = [
            SpanRecord("forward", now - 1e-3, now, "rank 0", _TRACE_A, "1" * 16, None, {}),
            SpanRecord("forward", now - 1e-3, now, "rank 0", _TRACE_B, "2" * 16, None, {}),
        ]
        path = f"/api/v1/sessions/{sessions['acme']}/trace_export"
        assert http.get(path, headers=zeta).status_code == 404
        polled = http.get(path, headers=acme)
        assert polled.status_code == 200 and polled.json()["status"] == "ready", polled.text
        url = polled.json()["url"]
        assert url.startswith("http://testserver/api/v1/trace_exports/"), url
        got = http.get(url.removeprefix("http://testserver"))  # no credentials: the URL is one
        assert got.status_code == 200, got.text
        events = [e for e in got.json()["traceEvents"] if e["ph"] == "X"]
        assert {e["args"]["trace_id"] for e in events} == {_TRACE_A}, events
        names = {(e["name"], e["args"]["trace_id"]) for e in events}
        assert ("forward", _TRACE_A) in names  # the rank's span of the session's call
        assert ("POST /api/v1/session_heartbeat", _TRACE_A) in names  # and the gateway's
        beat_span = next(e for e in events if e["name"] == "POST /api/v1/session_heartbeat")
        assert beat_span["args"]["tenant"] == "acme"  # its name, never its key
        assert http.get("/api/v1/trace_exports/not-a-token").status_code == 404


def test_trace_exports_expire_and_keep_each_partys_bound() -> None:
    """Each party keeps its newest exports: one tenant exporting in a loop pushes out only
    its own; and an export is gone after its time."""
    from trainctl.service import traces

    exports = traces.TraceExports(ttl_s=60.0)
    first = exports.add(b"{}", "alice")
    assert exports.get(first) == b"{}" and len(first) >= 32
    tokens = [exports.add(b"x" * 10, "carol") for _ in range(3 * traces.EXPORTS_PER_PARTY)]
    assert exports.get(first) == b"{}"  # carol's loop left alice's alone
    kept = [t for t in tokens if exports.get(t)]
    assert kept == tokens[-traces.EXPORTS_PER_PARTY :]  # carol's newest
    gone = traces.TraceExports(ttl_s=-1.0)
    assert gone.get(gone.add(b"{}", "alice")) is None  # past its time


_UTILIZATION = """
import time
from trainctl.workers import spans
from trainctl.workers.control.telemetry import BUSY_WINDOW_S, ControllerMetrics, utilization
from trainctl.workers.control.trackers import TrackerLog
from trainctl.api import OperationKind, StepResult

spans.install("controller")
now = time.time()
w = BUSY_WINDOW_S
spans.record("train_batch", now - w * 0.4, now - w * 0.2)  # the trainer: 20% of the window
spans.record("sample", now - w * 0.5, now - w * 0.3)  # two samples at once count once:
spans.record("sample", now - w * 0.45, now - w * 0.25)  # [0.5, 0.25] of the window
spans.record("weight_sync", now - w * 0.1, now - w * 0.05)  # 5%
for i in range(1, 101):  # queue waits of 1 .. 100 ms
    spans.record("queued", now - 1.0 - i / 1000, now - 1.0)
spans.record("queued", now - w * 3, now - w * 2)  # long ago: out of the window
got = utilization()
text = ControllerMetrics(queue_depth=lambda: 0).text().decode()
lines = {l.split(" ")[0]: float(l.split(" ")[1]) for l in text.splitlines()
         if l.startswith("trainctl_") and " " in l}
logged = []
class Tracker:
    def log(self, metrics, step):
        logged.append((metrics, step))
TrackerLog([Tracker()], utilization).observe(
    OperationKind.TRAIN_BATCH, StepResult(loss=1.0, step=3, metrics={}, timings={}))
print(repr((got, lines, logged)))
"""


def test_utilization_shares_and_queue_waits_reach_metrics_and_trackers() -> None:
    """The trainer's, the samplers' and the syncs' busy shares and the queue's wait p50/p99,
    from the controller's spans over the sliding window: in ``/metrics`` and logged with each
    step to the trackers (in a process of its own: its ring holds these spans alone)."""
    import ast
    import subprocess

    done = subprocess.run([sys.executable, "-c", _UTILIZATION], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got, lines, logged = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert got["trainer_busy"] == pytest.approx(0.2, abs=0.01)
    assert got["samplers_busy"] == pytest.approx(0.25, abs=0.01)
    assert got["sync_share"] == pytest.approx(0.05, abs=0.01)
    assert got["queue_wait_p50_s"] == pytest.approx(0.0505, abs=1e-3)
    assert got["queue_wait_p99_s"] == pytest.approx(0.099, abs=1e-3)
    assert lines["trainctl_samplers_busy_ratio"] == pytest.approx(0.25, abs=0.01)
    assert lines["trainctl_sync_share_ratio"] == pytest.approx(0.05, abs=0.01)
    assert lines['trainctl_queue_wait_recent_seconds{quantile="0.99"}'] == pytest.approx(
        0.099, abs=1e-3
    )
    [(metrics, step)] = logged
    assert step == 3 and metrics["utilization/samplers_busy"] == pytest.approx(0.25, abs=0.01)


def test_a_timed_block_reports_its_own_spans_length() -> None:
    """A timing from ``spans.timed`` (a step's ``forward_backward_max_s``) is the length of
    the span the timeline shows, measured once; a block inside it is its child."""
    ring = spans.install("controller")  # this process's ring (another test may have made it)
    assert ring is not None
    with spans.timed("timed-outer", op="op-t") as t:
        time.sleep(0.02)
        with spans.timed("timed-inner"):
            pass
    got = {
        s.name: s for s in ring.between(t.start_s - 1, t.end_s + 1) if s.name.startswith("timed")
    }
    outer, inner = got["timed-outer"], got["timed-inner"]
    assert t.seconds >= 0.02 and outer.end_s - outer.start_s == pytest.approx(t.seconds, abs=1e-6)
    assert inner.parent_id == outer.span_id and outer.attrs == {"op": "op-t"}


def test_a_session_keeps_only_its_newest_traces() -> None:
    from trainctl.service.tinker.state import TRACES_PER_SESSION, Session

    spans.install("controller")
    s = Session("s1")
    ids = []
    for _ in range(TRACES_PER_SESSION + 100):
        with spans.span("call") as current:
            s.traced()
            s.traced()  # a call that reads its session twice is one trace
            ids.append(format(current.get_span_context().trace_id, "032x"))
    assert list(s.traces) == ids[-TRACES_PER_SESSION:]
