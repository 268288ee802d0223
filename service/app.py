"""The FastAPI gateway: validates requests and hands them to the controller.

(No ``from __future__ import annotations`` in the gateway's modules: Serve re-registers the
routes inside its replica, where string annotations of a by-value-pickled app would not
resolve.)

``create_app(controller)`` builds the app around any ``ControllerAPI``; it runs under Ray Serve
(``service/deployment.py``) and, in the fast test tier, under ``TestClient`` with a fake. The
routes live in ``service/routes/``, one module per resource; this module adds what wraps them:
metrics, the error bodies (``service/errors.py``), the OpenAPI schema and the opt-in
fault injection. A request is validated in full (shapes, types, token ids against the model's
vocabulary, lengths against its maximum) before the controller sees it: a rejected request
changes nothing.
"""

import contextlib
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from trainctl.api import API_VERSION, SampleRequest, TrainctlError
from trainctl.api.operations import ROUTED
from trainctl.service import routes
from trainctl.service.auth import Access, access, authorize, is_operator
from trainctl.service.codec import BODY_GRACE_S, BODY_TIMEOUT_S
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.errors import install_error_handlers
from trainctl.service.metrics import GatewayMetrics, pseudonymous_tenants, tenant_usage
from trainctl.service.shares import Bounds, Shares
from trainctl.service.tenants import TenantKeys
from trainctl.service.tinker import routes as tinker_routes
from trainctl.workers import spans

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
DEFAULT_MAX_SEQUENCES = 16384
DEFAULT_MAX_TOKENS_PER_REQUEST = 1 << 24


def _install_spans(app: FastAPI, size: int, otlp_endpoint: str | None) -> None:
    """One span per request on the gateway's row of the timeline."""

    @app.middleware("http")
    async def _span(request: Request, call_next: Any) -> Any:
        if not spans.installed():  # the serving process's first request (the app is pickled)
            spans.install("gateway", size=size, otlp_endpoint=otlp_endpoint)
        parent = request.headers.get("traceparent")  # the caller's trace (W3C), if it sent one
        with spans.span(f"{request.method} {request.url.path}", parent=parent) as current:
            response = await call_next(request)
            current.set_attribute("http.status_code", response.status_code)
            tenant = getattr(request.state, "tenant", None)  # its name, never its key
            if tenant is not None:  # every span of this trace works for it
                current.set_attribute("tenant", tenant)
            return response


def _install_metrics(app: FastAPI, open_metrics: bool) -> None:
    metrics: GatewayMetrics = app.state.metrics

    @app.middleware("http")
    async def _observe(request: Request, call_next: Any) -> Any:
        t0 = time.perf_counter()
        response = await call_next(request)
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None:
            length = request.headers.get("content-length", "")
            metrics.count_tenant(tenant, int(length) if length.isdigit() else 0)
        route = getattr(request.scope.get("route"), "path", None) or "unmatched"
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)
        return response

    @app.get("/metrics", include_in_schema=False)
    @access(Access.OPEN if open_metrics else Access.BEARER)
    async def prometheus(request: Request) -> Response:
        """Prometheus text: the gateway's metrics, then the controller's."""
        controller: ControllerAPI = request.app.state.controller
        try:
            tail = await controller.metrics_text()
        except TrainctlError:
            tail = b""
        with contextlib.suppress(TrainctlError):  # the controller may not be ready yet
            await tenant_usage(request)  # sets the adapters-per-tenant gauge
        text = metrics.text()
        if not is_operator(request):  # an open scrape learns counts, not who the tenants are
            text = pseudonymous_tenants(text, metrics.secret)
        return Response(text + tail, media_type="text/plain; version=0.0.4")


def _openapi(app: FastAPI) -> Any:
    """The generated schema plus the request models that operation routes read themselves."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            models: list[type[BaseModel]] = [op.request for op in ROUTED] + [SampleRequest]
            for model in models:
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[model.__name__] = spec
            app.openapi_schema = schema
        return app.openapi_schema

    return build


def _install_fault_injection(app: FastAPI) -> None:
    """``POST /v1/debug/faults``: make a rank fail on purpose (chaos testing; opt-in, hidden
    from the schema, behind auth like every /v1 route)."""

    class FaultRequest(BaseModel):
        rank: int = Field(ge=0)
        phase: str = Field(
            description="forward, accumulate_end, forward_backward_end, finish_window, "
            "optimizer, optimizer_end (after the rank's update, before the ZeRO-1 all-gather), "
            "publish, or broadcast_stall (rank 0 stops 10 s after the first bucket of its next "
            "broadcast to the samplers)"
        )
        times: int = Field(1, ge=1, le=100)
        kill: bool = Field(
            False, description="The rank's process dies there (SIGKILL) instead of raising."
        )

    @app.post(f"/{API_VERSION}/debug/faults", include_in_schema=False)
    async def inject_fault(req: FaultRequest, request: Request) -> dict[str, str]:
        controller: ControllerAPI = request.app.state.controller
        await controller.inject_fault(req.rank, req.phase, req.times, req.kill)
        log.warning(
            "fault injected: rank %d fails in %s (%d time(s))", req.rank, req.phase, req.times
        )
        return {"status": "armed"}


def create_app(
    controller: ControllerAPI,
    *,
    api_token: str | None = None,
    api_keys_file: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    max_tokens_per_request: int = DEFAULT_MAX_TOKENS_PER_REQUEST,
    body_timeout_s: float = BODY_TIMEOUT_S,
    body_grace_s: float = BODY_GRACE_S,
    fault_injection: bool = False,
    tinker_order_timeout_s: float = 60.0,
    tinker_bounds: Bounds | None = None,
    open_metrics: bool = True,
    open_docs: bool = True,
    instance_id: str = "",
    trace_spans: int = spans.RING_SPANS,
    otlp_endpoint: str | None = None,
) -> FastAPI:
    """The gateway around ``controller``; with ``api_token``, every route but the open ones
    (``service/auth.py``) needs it; ``api_keys_file``: tenants' keys to the Tinker routes.
    ``open_metrics`` / ``open_docs``: ``/metrics`` and the API docs (``/docs``,
    ``/openapi.json``) answer without the token; when closed, /metrics and /openapi.json need
    it and the browser docs are off. ``tinker_bounds``: the Tinker tables' bounds, each
    shared out among the tenants and the operator (``service/shares.py``). ``trace_spans``
    and ``otlp_endpoint``: the gateway's ring of spans and their exporter (``workers/spans.py``),
    made in the process that serves the app, at its first request."""
    docs: dict[str, Any] = (
        {} if open_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    )
    app = FastAPI(
        **docs,
        title="trainctl",
        version="0.1.0",
        description="Training control for RL post-training: train_batch, eval_batch, log-probs "
        "and memory profiles over megatron-core ranks on Ray.",
        # Every route checks its declared access (service/auth.py): deny by default.
        dependencies=[Depends(authorize)],
    )
    app.state.controller = controller
    app.state.api_token = api_token or None
    app.state.api_keys = TenantKeys(api_keys_file) if api_keys_file else None
    app.state.instance_id = instance_id
    _install_spans(app, trace_spans, otlp_endpoint)
    app.state.max_body_bytes = max_body_bytes
    app.state.body_timeout_s = body_timeout_s
    app.state.body_grace_s = body_grace_s
    app.state.request_caps = {
        "max_sequences": max_sequences,
        "max_tokens_per_request": max_tokens_per_request,
    }
    app.state.metrics = GatewayMetrics()
    _install_metrics(app, open_metrics)
    install_error_handlers(app)
    routes.include(app)
    keys: TenantKeys | None = app.state.api_keys
    shares = Shares(tinker_bounds, lambda: 0 if keys is None else len(keys.tenants))
    tinker_routes.install(app, order_timeout_s=tinker_order_timeout_s, shares=shares)
    app.state.metrics.track_evictions(app.state.tinker.evicted)
    app.state.metrics.track_shares(shares)
    if keys is not None:
        app.state.metrics.track_keys(keys)
    if fault_injection:
        _install_fault_injection(app)
    app.openapi = _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented hook
    if not open_docs:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_json() -> dict[str, Any]:
            return app.openapi()

    return app
