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
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        made = spans.make_provider(
            "rank 2", size=10, otlp_endpoint=f"http://127.0.0.1:{server.server_port}"
        )
        tracer = made.provider.get_tracer("test")
        with tracer.start_as_current_span("accumulate", attributes={"op": "op-7"}):
            pass
        made.provider.force_flush()
        made.provider.shutdown()
    finally:
        server.shutdown()
    assert received, "the receiver got nothing"
    [resource_spans] = [rs for r in received for rs in r.resource_spans]
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "trainctl" and resource["trainctl.row"] == "rank 2"
    [sent] = [s for ss in resource_spans.scope_spans for s in ss.spans]
    assert sent.name == "accumulate"
    assert {a.key: a.value.string_value for a in sent.attributes} == {"op": "op-7"}
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
