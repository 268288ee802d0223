"""An OTLP/HTTP receiver in the test's process: it decodes every batch of spans it is sent,
as the OpenTelemetry collector would, and keeps them to be read back."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Received:
    row: str
    """The sending process's row (its resource's ``trainctl.row``)."""
    service: str
    name: str
    trace_id: str
    attrs: dict[str, str | int | float | bool]


class Receiver:
    """The spans received so far. Owns its HTTP server and thread."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    receiver._take(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        got = []
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    got.append(Received(resource.get("trainctl.row", ""),
                                        resource.get("service.name", ""), s.name,
                                        s.trace_id.hex(), attrs))  # fmt: skip
        with self._lock:
            self.spans += got

    def received(self) -> list[Received]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()


def _value(v: object) -> str | int | float | bool:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else ""  # type: ignore[no-any-return]


@contextmanager
def receiving() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()
