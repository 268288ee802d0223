"""The FastAPI gateway: validates requests and hands them to the controller.

(No ``from __future__ import annotations`` here: Serve re-registers the routes inside its
replica, where string annotations of a by-value-pickled app would not resolve.)

``create_app(controller)`` builds the app around any ``ControllerAPI``; it runs under Ray Serve
(``service/deployment.py``) and, in the fast test tier, under ``TestClient`` with a fake.
A request is validated in full (shapes, types, token ids against the model's vocabulary,
lengths against its maximum) before the controller sees it: a rejected request changes nothing.
"""

import hmac
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from trainctl.api import (
    API_VERSION,
    ErrorBody,
    ErrorType,
    EvalBatchRequest,
    Health,
    Info,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    ModelLimits,
    StepResult,
    TrainBatchRequest,
    TrainctlError,
)
from trainctl.service.controller_client import ControllerAPI

log = logging.getLogger(__name__)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorBody, "description": "Invalid request: the message names the field."},
    503: {"model": ErrorBody, "description": "Workers starting, recovering or shutting down."},
    500: {"model": ErrorBody, "description": "A rank failed; the step was not applied."},
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


def _loc(loc: tuple[Any, ...]) -> str:
    """``('body', 'sequences', 0, 'tokens', 3)`` -> ``sequences[0].tokens[3]``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _error(status: int, body: ErrorBody) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _loc(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        details = [
            {"field": _loc(tuple(e.get("loc", ()))), "problem": e.get("msg"), "type": e.get("type")}
            for e in errors[:20]
        ]
        # A model-level check names its field in the message itself.
        message = msg if field == "body" else f"{field}: {msg}"
        return _error(
            422, ErrorBody(type=ErrorType.INVALID_REQUEST, message=message, details=details)
        )

    @app.exception_handler(TrainctlError)
    async def _domain(request: Request, exc: TrainctlError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return _error(exc.status, exc.body())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error(
            500, ErrorBody(type=ErrorType.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        )


def _router() -> APIRouter:
    r = APIRouter(prefix=f"/{API_VERSION}", responses=_ERROR_RESPONSES)

    @r.post("/train_batch", response_model=StepResult, tags=["training"])
    async def train_batch(
        req: TrainBatchRequest, controller: ControllerDep, limits: LimitsDep
    ) -> StepResult:
        """Forward/backward over the batch on every rank, then one optimizer step."""
        req.check_limits(limits)
        return await controller.train_batch(req)

    @r.post("/eval_batch", response_model=StepResult, tags=["training"])
    async def eval_batch(
        req: EvalBatchRequest, controller: ControllerDep, limits: LimitsDep
    ) -> StepResult:
        """The training loss of the batch, without backward or update."""
        req.check_limits(limits)
        return await controller.eval_batch(req)

    @r.post("/memory_profile/start", response_model=MemoryProfileStarted, tags=["profiling"])
    async def start_memory_profile(
        controller: ControllerDep, req: MemoryProfileStartRequest | None = None
    ) -> MemoryProfileStarted:
        """Every rank starts recording its allocations."""
        max_entries = (req or MemoryProfileStartRequest()).max_entries
        return await controller.start_memory_profile(max_entries)

    @r.post("/memory_profile/stop", response_model=MemoryProfileResult, tags=["profiling"])
    async def stop_memory_profile(controller: ControllerDep) -> MemoryProfileResult:
        """Every rank stops recording and writes one file; lists the files with their sizes."""
        return await controller.stop_memory_profile()

    @r.get("/info", response_model=Info, tags=["service"])
    async def info(controller: ControllerDep) -> Info:
        """Model config, parallel layout, step, weights digest and versions."""
        return await controller.info()

    @r.get("/health", response_model=Health, tags=["service"])
    async def health() -> Health:
        """Liveness: the gateway answers."""
        return Health(status="ok")

    @r.get("/ready", response_model=Health, tags=["service"], responses={503: {"model": ErrorBody}})
    async def ready(controller: ControllerDep) -> Any:
        """Readiness: every rank is built and the service takes work."""
        if await controller.is_ready():
            return Health(status="ready")
        return _error(503, ErrorBody(type=ErrorType.NOT_READY, message="workers not ready"))

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
                return _error(
                    401,
                    ErrorBody(
                        type=ErrorType.UNAUTHORIZED,
                        message="missing bearer token: send 'Authorization: Bearer <token>'",
                    ),
                )
            if not hmac.compare_digest(given.strip().encode(), expected):
                return _error(
                    403,
                    ErrorBody(type=ErrorType.FORBIDDEN, message="the bearer token is not valid"),
                )
        return await call_next(request)


def create_app(controller: ControllerAPI, *, api_token: str | None = None) -> FastAPI:
    """The gateway around ``controller``; with ``api_token``, /v1 routes need it as a bearer."""
    app = FastAPI(
        title="trainctl",
        version="0.1.0",
        description="Training control for RL post-training: train_batch, eval_batch and memory "
        "profiles over megatron-core ranks on Ray.",
    )
    app.state.controller = controller
    if api_token:
        _install_auth(app, api_token)
    _install_error_handlers(app)
    app.include_router(_router())
    return app
