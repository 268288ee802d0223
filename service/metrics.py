"""The gateway's Prometheus metrics (requests, latency, errors by type) and ``/metrics``.

``/metrics`` serves these followed by the controller's (steps, tokens, operation latency,
queue depth: ``workers/control/telemetry.py``). Each registry is private: Ray's own metrics use
prometheus_client's global one.
"""

import hmac
import re
import secrets
from collections.abc import Callable, Iterator, Mapping

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from trainctl.api import TenantUsage
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.shares import Shares
from trainctl.service.tenants import TenantKeys, scoped

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


TENANT_LABEL = re.compile(rb'tenant="([^"]*)"')


def pseudonymous_tenants(text: bytes, secret: bytes) -> bytes:
    """``text`` (Prometheus') with every tenant label's name replaced by a pseudonym: stable
    for the gateway's life, so series stay series, and the operator's ``_operator`` kept."""

    def pseudonym(m: re.Match[bytes]) -> bytes:
        name = m.group(1)
        if name == b"_operator":
            return m.group(0)
        return b'tenant="t-' + hmac.new(secret, name, "sha256").hexdigest()[:12].encode() + b'"'

    return TENANT_LABEL.sub(pseudonym, text)


class GatewayMetrics:
    """Owns the gateway's metrics registry, and the secret of its tenants' pseudonyms on an
    open ``/metrics`` (``pseudonymous_tenants``)."""

    def __init__(self) -> None:
        self.secret = secrets.token_bytes(32)
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
        self.tenant_requests = Counter(
            "trainctl_tenant_requests", "Requests by tenant (--api-keys).", ["tenant"], registry=r
        )
        self.tenant_bytes = Counter(
            "trainctl_tenant_request_bytes", "Request body bytes by tenant (as declared).",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.tenant_adapters = Gauge(
            "trainctl_tenant_adapters", "LoRA adapters in each tenant's space.", ["tenant"],
            registry=r,
        )  # fmt: skip

    def count_tenant(self, tenant: str, nbytes: int) -> None:
        self.tenant_requests.labels(tenant).inc()
        self.tenant_bytes.labels(tenant).inc(nbytes)

    def tenant_usage(self, tenants: set[str], adapters: list[str]) -> dict[str, TenantUsage]:
        """Each tenant's counts, with its adapters (of ``adapters``, every adapter's name)
        counted now; the gauge follows."""
        out = {}
        for t in sorted(tenants):
            held = sum(1 for a in adapters if a.startswith(scoped(t, "")))
            self.tenant_adapters.labels(t).set(held)
            out[t] = TenantUsage(
                requests=int(self.tenant_requests.labels(t)._value.get()),
                bytes=int(self.tenant_bytes.labels(t)._value.get()),
                adapters=held,
            )
        return out

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

    def track_keys(self, keys: TenantKeys) -> None:
        """``trainctl_api_keys_reloads{outcome}``: the tenant keys file's reloads since start,
        by outcome (``applied``, ``partial``: bad lines refused, ``revoked``: every key)."""
        registry = self.registry

        class Collector:
            def collect(self) -> Iterator[Metric]:
                family = CounterMetricFamily(
                    "trainctl_api_keys_reloads",
                    "Reloads of the tenant keys file since start, by outcome.",
                    labels=["outcome"],
                )
                for outcome, n in keys.outcomes.items():
                    family.add_metric([outcome], n)
                yield family

        registry.register(Collector())

    def track_shares(self, shares: Shares) -> None:
        """``trainctl_tenant_evictions{tenant,table}`` and ``trainctl_tenant_refusals``: what
        each party's share of each table evicted of its own, and refused it (the operator's
        label is ``_operator``)."""
        registry = self.registry

        class Collector:
            def collect(self) -> Iterator[Metric]:
                for name, counts, doc in (
                    ("trainctl_tenant_evictions", shares.evicted,
                     "Entries of a party's evicted to make room for its own, by table."),
                    ("trainctl_tenant_refusals", shares.refused,
                     "Calls refused for being over the party's share, by table."),
                ):  # fmt: skip
                    family = CounterMetricFamily(name, doc, labels=["tenant", "table"])
                    for (tenant, table), n in sorted(counts.items()):
                        family.add_metric([tenant, table], n)
                    yield family

        registry.register(Collector())

    def text(self) -> bytes:
        return generate_latest(self.registry)


async def tenant_usage(request: Request) -> dict[str, TenantUsage] | None:
    """Each tenant's counts (None: no tenant keys)."""
    keys: TenantKeys | None = request.app.state.api_keys
    if keys is None:
        return None
    controller: ControllerAPI = request.app.state.controller
    adapters = [a.name for a in (await controller.list_adapters()).adapters]
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics.tenant_usage(keys.tenants, adapters)
