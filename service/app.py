"""The FastAPI gateway: validates requests and hands them to the controller.

(No ``from __future__ import annotations`` here: Serve re-registers the routes inside its
replica, where string annotations of a by-value-pickled app would not resolve.)

``create_app(controller)`` builds the app around any ``ControllerAPI``; it runs under Ray Serve
(``service/deployment.py``) and, in the fast test tier, under ``TestClient`` with a fake.
A request is validated in full (shapes, types, token ids against the model's vocabulary,
lengths against its maximum) before the controller sees it: a rejected request changes nothing.

Long calls (``train_batch``, ``eval_batch``, ``logprobs``) are operations: with
``Prefer: respond-async`` they answer 202 with an operation to poll at ``/v1/operations/{id}``;
otherwise they answer when done. ``Idempotency-Key`` makes any of them safe to retry.
"""

import hmac
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainctl.api import (
    API_VERSION,
    CheckpointInfo,
    CheckpointList,
    ErrorBody,
    ErrorType,
    EvalBatchRequest,
    ExportRequest,
    ExportResult,
    Health,
    Info,
    LogProbsRequest,
    LogProbsResult,
    MemoryProfileList,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    ModelLimits,
    Operation,
    StepResult,
    TrainBatchRequest,
    TrainctlError,
    wire,
)
from trainctl.service.codec import decode_request, encode_response
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.metrics import GatewayMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
MAX_WAIT_S = 60.0

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorBody, "description": "Invalid request: the message names the field."},
    503: {"model": ErrorBody, "description": "Workers starting, recovering or shutting down."},
    500: {"model": ErrorBody, "description": "A rank failed; the step was not applied."},
}
_OPERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"model": Operation, "description": "Accepted (Prefer: respond-async): poll it."},
    409: {"model": ErrorBody, "description": "Idempotency key reused, or expected_step stale."},
    413: {"model": ErrorBody, "description": "The body exceeds the configured maximum."},
    429: {"model": ErrorBody, "description": "The operation queue is full; see Retry-After."},
}


def get_controller(request: Request) -> ControllerAPI:
    return request.app.state.controller  # type: ignore[no-any-return]


ControllerDep = Annotated[ControllerAPI, Depends(get_controller)]


async def get_limits(request: Request, controller: ControllerDep) -> ModelLimits:
    """The model's limits, fetched from the controller once and cached."""
    limits: ModelLimits | None = getattr(request.app.state, "limits", None)
    if limits is None:
        limits = await controller.model_limits()
        request.app.state.limits = limits
    return limits


LimitsDep = Annotated[ModelLimits, Depends(get_limits)]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Retries with the same key return the first call's result.",
    ),
]
Prefer = Annotated[
    str | None,
    Header(description="'respond-async': answer 202 with an operation to poll."),
]


def _loc(loc: tuple[Any, ...]) -> str:
    """``('body', 'sequences', 0, 'tokens', 3)`` -> ``sequences[0].tokens[3]``."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "header", "query", "path") else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _error(
    request: Request, status: int, body: ErrorBody, headers: dict[str, str] | None = None
) -> JSONResponse:
    metrics: GatewayMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.errors.labels(body.type.value).inc()
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"), headers=headers)


def _validation_error(request: Request, errors: list[Any]) -> JSONResponse:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    details = [
        {"field": _loc(tuple(e.get("loc", ()))), "problem": e.get("msg"), "type": e.get("type")}
        for e in errors[:20]
    ]
    # A model-level check names its field in the message itself; a malformed body does not.
    model_check = field == "body" and first.get("type") == "value_error"
    message = msg if model_check else f"{field}: {msg}"
    body = ErrorBody(type=ErrorType.INVALID_REQUEST, message=message, details=details)
    return _error(request, 422, body)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(request, list(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _model_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return _validation_error(request, list(exc.errors(include_url=False)))

    @app.exception_handler(TrainctlError)
    async def _domain(request: Request, exc: TrainctlError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return _error(request, exc.status, exc.body(), headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(request, exc.status_code, ErrorBody(type=kind, message=message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        body = ErrorBody(type=ErrorType.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        return _error(request, 500, body)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body: the model as JSON, or a binary frame (``api/wire.py``)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                wire.JSON_CONTENT_TYPE: {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                },
                wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


async def _operation_call(
    request: Request,
    controller: ControllerAPI,
    limits: ModelLimits,
    kind: str,
    model: type[BaseModel],
    key: str | None,
    prefer: str | None,
) -> Response:
    decoded = await decode_request(request, model, request.app.state.max_body_bytes)
    metrics: GatewayMetrics = request.app.state.metrics
    encoding = "binary" if "tensors" in request.headers.get("content-type", "") else "json"
    metrics.request_bytes.labels(encoding).inc(decoded.nbytes)
    req = decoded.model
    req.check_limits(limits)
    return await _dispatch(request, controller, kind, req, key, decoded.fingerprint, prefer)


async def _dispatch(
    request: Request,
    controller: ControllerAPI,
    kind: str,
    req: Any,
    key: str | None,
    fingerprint: str,
    prefer: str | None,
) -> Response:
    """Run the operation and answer its result, or (``Prefer: respond-async``) 202 at once."""
    if prefer and "respond-async" in prefer.lower():
        op = await controller.submit(kind, req, key, fingerprint)
        log.info("%s accepted as %s", kind, op.id, extra={"op": op.id})
        location = f"/{API_VERSION}/operations/{op.id}"
        return encode_response(request, op, 202, headers={"Location": location})
    return encode_response(request, await controller.run(kind, req, key, fingerprint))


_OPERATION_ROUTES: list[tuple[str, type[BaseModel], type[BaseModel], str]] = [
    (
        "train_batch",
        TrainBatchRequest,
        StepResult,
        "Forward/backward over the batch on every rank, then one optimizer step.",
    ),
    ("eval_batch", EvalBatchRequest, StepResult, "The training loss, without backward or update."),
    (
        "logprobs",
        LogProbsRequest,
        LogProbsResult,
        "Forward only: per-token log-probs (and entropy) of each sequence, in request order.",
    ),
]


def _add_operation_route(
    r: APIRouter, kind: str, model: type[BaseModel], result: type[BaseModel], doc: str
) -> None:
    async def endpoint(
        request: Request,
        controller: ControllerDep,
        limits: LimitsDep,
        idempotency_key: IdempotencyKey = None,
        prefer: Prefer = None,
    ) -> Response:
        args = (kind, model, idempotency_key, prefer)
        return await _operation_call(request, controller, limits, *args)

    r.add_api_route(
        f"/{kind}",
        endpoint,
        methods=["POST"],
        name=kind,
        description=doc,
        response_model=result,
        openapi_extra=_body_doc(model),
        tags=["training"],
        responses=_OPERATION_RESPONSES,
    )


def _router() -> APIRouter:
    # operationId = the route's RPC name (train_batch, start_memory_profile, ...), so that
    # generated clients read naturally; FastAPI's default appends the path and method.
    r = APIRouter(
        prefix=f"/{API_VERSION}",
        responses=_ERROR_RESPONSES,
        generate_unique_id_function=lambda route: route.name,
    )
    for kind, model, result, doc in _OPERATION_ROUTES:
        _add_operation_route(r, kind, model, result, doc)

    @r.get("/operations/{op_id}", response_model=Operation, tags=["training"])
    async def get_operation(
        request: Request,
        op_id: str,
        controller: ControllerDep,
        wait: Annotated[
            float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for it to finish.")
        ] = 0.0,
    ) -> Response:
        """An operation: queued (with its position), running (with its phase), done (with the
        result) or failed (with the error)."""
        return encode_response(request, await controller.operation(op_id, wait))

    @r.post("/memory_profile/start", response_model=MemoryProfileStarted, tags=["profiling"])
    async def start_memory_profile(
        controller: ControllerDep, req: MemoryProfileStartRequest | None = None
    ) -> MemoryProfileStarted:
        """Every rank starts recording its allocations."""
        max_entries = (req or MemoryProfileStartRequest()).max_entries
        return await controller.run("memory_profile_start", max_entries)  # type: ignore[no-any-return]

    @r.post("/memory_profile/stop", response_model=MemoryProfileResult, tags=["profiling"])
    async def stop_memory_profile(controller: ControllerDep) -> MemoryProfileResult:
        """Every rank stops recording; the controller stores one file and one picture per rank."""
        return await controller.run("memory_profile_stop")  # type: ignore[no-any-return]

    @r.get("/memory_profiles", response_model=MemoryProfileList, tags=["profiling"])
    async def list_memory_profiles(controller: ControllerDep) -> MemoryProfileList:
        """The profiles taken, oldest first, with each rank's file and picture."""
        return await controller.list_profiles()

    @r.get("/memory_profiles/{profile_id}", response_model=MemoryProfileResult, tags=["profiling"])
    async def get_memory_profile(profile_id: str, controller: ControllerDep) -> MemoryProfileResult:
        return await controller.get_profile(profile_id)

    @r.get(
        "/memory_profiles/{profile_id}/files/{name}",
        tags=["profiling"],
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}, "image/png": {}}}},
    )
    async def download_memory_profile_file(
        profile_id: str, name: str, controller: ControllerDep
    ) -> Response:
        """One rank's profile file (Chrome trace or CUDA snapshot) or its PNG picture."""
        data = await controller.read_profile_file(profile_id, name)
        media = {"png": "image/png", "json": "application/json"}.get(
            name.rsplit(".", 1)[-1], "application/octet-stream"
        )
        return Response(
            data,
            media_type=media,
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

    ck = {"responses": _OPERATION_RESPONSES, "tags": ["checkpoints"]}

    @r.post("/checkpoints", response_model=CheckpointInfo, **ck)  # type: ignore[arg-type]
    async def save_checkpoint(
        request: Request,
        controller: ControllerDep,
        idempotency_key: IdempotencyKey = None,
        prefer: Prefer = None,
    ) -> Response:
        """Save the whole training state (weights, optimizer, step, RNG) of every rank; the
        checkpoint appears only once complete."""
        args = ("checkpoint_save", None, idempotency_key, "", prefer)
        return await _dispatch(request, controller, *args)

    @r.get("/checkpoints", response_model=CheckpointList, tags=["checkpoints"])
    async def list_checkpoints(controller: ControllerDep) -> CheckpointList:
        """Complete checkpoints, oldest first."""
        return await controller.list_checkpoints()

    @r.post("/checkpoints/{checkpoint_id}/load", response_model=CheckpointInfo, **ck)  # type: ignore[arg-type]
    async def load_checkpoint(
        request: Request,
        checkpoint_id: str,
        controller: ControllerDep,
        idempotency_key: IdempotencyKey = None,
        prefer: Prefer = None,
    ) -> Response:
        """Restore a checkpoint saved with this layout: weights, optimizer state and step."""
        args = ("checkpoint_load", checkpoint_id, idempotency_key, checkpoint_id, prefer)
        return await _dispatch(request, controller, *args)

    @r.post("/export/hf", response_model=ExportResult, **ck)  # type: ignore[arg-type]
    async def export_hf(
        request: Request,
        controller: ControllerDep,
        req: ExportRequest | None = None,
        idempotency_key: IdempotencyKey = None,
        prefer: Prefer = None,
    ) -> Response:
        """Write the full model as a Hugging Face Llama checkpoint (config.json and
        model.safetensors) under the server's export root."""
        req = req or ExportRequest()
        args = ("export_hf", req, idempotency_key, req.model_dump_json(), prefer)
        return await _dispatch(request, controller, *args)

    @r.get("/info", response_model=Info, tags=["service"])
    async def info(controller: ControllerDep) -> Info:
        """Model config, parallel layout, step, weights digest and versions."""
        return await controller.info()

    @r.get("/health", response_model=Health, tags=["service"])
    async def health() -> Health:
        """Liveness: the gateway answers."""
        return Health(status="ok")

    @r.get("/ready", response_model=Health, tags=["service"], responses={503: {"model": ErrorBody}})
    async def ready(request: Request, controller: ControllerDep) -> Any:
        """Readiness: every rank is built and the service takes work."""
        if await controller.is_ready():
            return Health(status="ready")
        body = ErrorBody(type=ErrorType.NOT_READY, message="workers not ready")
        return _error(request, 503, body, {"Retry-After": "2"})

    return r


_OPEN_PATHS = (f"/{API_VERSION}/health", f"/{API_VERSION}/ready")


def _install_auth(app: FastAPI, api_token: str) -> None:
    """Bearer token on every /v1 route but health and readiness: 401 without, 403 if wrong.

    The token is compared in constant time and never logged or echoed in an error body.
    """
    expected = api_token.encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        path = request.url.path
        if path.startswith(f"/{API_VERSION}/") and path not in _OPEN_PATHS:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:
                body = ErrorBody(
                    type=ErrorType.UNAUTHORIZED,
                    message="missing bearer token: send 'Authorization: Bearer <token>'",
                )
                return _error(request, 401, body)
            if not hmac.compare_digest(given.strip().encode(), expected):
                body = ErrorBody(type=ErrorType.FORBIDDEN, message="the bearer token is not valid")
                return _error(request, 403, body)
        return await call_next(request)


def _install_metrics(app: FastAPI) -> None:
    metrics: GatewayMetrics = app.state.metrics

    @app.middleware("http")
    async def _observe(request: Request, call_next: Any) -> Any:
        t0 = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", None) or "unmatched"
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)
        return response

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(request: Request) -> Response:
        """Prometheus text: the gateway's metrics, then the controller's."""
        controller: ControllerAPI = request.app.state.controller
        try:
            tail = await controller.metrics_text()
        except TrainctlError:
            tail = b""
        return Response(metrics.text() + tail, media_type="text/plain; version=0.0.4")


def _openapi(app: FastAPI) -> Any:
    """The generated schema plus the request models that routes read themselves."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (TrainBatchRequest, EvalBatchRequest, LogProbsRequest):
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
        phase: str = Field(description="forward, accumulate_end or optimizer")
        times: int = Field(1, ge=1, le=100)

    @app.post(f"/{API_VERSION}/debug/faults", include_in_schema=False)
    async def inject_fault(req: FaultRequest, request: Request) -> dict[str, str]:
        controller: ControllerAPI = request.app.state.controller
        await controller.inject_fault(req.rank, req.phase, req.times)
        log.warning(
            "fault injected: rank %d fails in %s (%d time(s))", req.rank, req.phase, req.times
        )
        return {"status": "armed"}


def create_app(
    controller: ControllerAPI,
    *,
    api_token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    fault_injection: bool = False,
) -> FastAPI:
    """The gateway around ``controller``; with ``api_token``, /v1 routes need it as a bearer."""
    app = FastAPI(
        title="trainctl",
        version="0.1.0",
        description="Training control for RL post-training: train_batch, eval_batch, log-probs "
        "and memory profiles over megatron-core ranks on Ray.",
    )
    app.state.controller = controller
    app.state.max_body_bytes = max_body_bytes
    app.state.metrics = GatewayMetrics()
    if api_token:
        _install_auth(app, api_token)
    _install_metrics(app)
    _install_error_handlers(app)
    app.include_router(_router())
    if fault_injection:
        _install_fault_injection(app)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app
