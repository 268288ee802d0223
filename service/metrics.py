"""The gateway's Prometheus metrics (requests, latency, errors by type) and ``/metrics``.

``/metrics`` serves these followed by the controller's (steps, tokens, operation latency,
queue depth: ``workers/control/telemetry.py``). Each registry is private: Ray's own metrics use
prometheus_client's global one.
"""

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "trainctl_http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "trainctl_http_request_seconds",
            "HTTP request latency at the gateway, by route.",
            ["route"],
            buckets=BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "trainctl_http_errors",
            "Error responses, by error type (the 'type' of the body).",
            ["type"],
            registry=r,
        )
        self.request_bytes = Counter(
            "trainctl_http_request_bytes", "Request body bytes read, by encoding.", ["encoding"],
            registry=r,
        )  # fmt: skip

    def track_evictions(self, evicted: Mapping[str, int]) -> None:
        """``trainctl_gateway_evictions{table}``: the live counts of ``evicted``."""
        g = Gauge(
            "trainctl_gateway_evictions",
            "Entries dropped from a bounded table of the gateway since start, by table.",
            ["table"],
            registry=self.registry,
        )

        def count(table: str) -> Callable[[], float]:
            return lambda: float(evicted[table])

        for table in evicted:
            g.labels(table).set_function(count(table))

    def text(self) -> bytes:
        return generate_latest(self.registry)
