"""The service itself: what is served, liveness and readiness."""

from typing import Any

from fastapi import Request

from trainctl.api import ErrorBody, ErrorType, Health, Info
from trainctl.service.auth import Access, access
from trainctl.service.errors import error_response
from trainctl.service.metrics import tenant_usage
from trainctl.service.routes.deps import ControllerDep, resource_router

router = resource_router("service")


@router.get("/info", response_model=Info)
async def info(request: Request, controller: ControllerDep) -> Info:
    """Model config, parallel layout, step, weights digest and versions (and, with tenant
    keys, each tenant's requests, bytes and adapters)."""
    served = await controller.info()
    tenants = await tenant_usage(request)
    return served if tenants is None else served.model_copy(update={"tenants": tenants})


@router.get("/health", response_model=Health, response_model_exclude_none=True)
@access(Access.OPEN)
async def health(request: Request) -> Health:
    """Liveness: the gateway answers."""
    return _health(request, "ok")


@router.get(
    "/ready", response_model=Health, response_model_exclude_none=True,
    responses={503: {"model": ErrorBody}},
)  # fmt: skip
@access(Access.OPEN)
async def ready(request: Request, controller: ControllerDep) -> Any:
    """Readiness: every rank is built and the service takes work; with samplers, their
    engines by status."""
    if await controller.is_ready():
        health = _health(request, "ready")
        health.samplers = await controller.sampler_statuses()
        return health
    body = ErrorBody(type=ErrorType.NOT_READY, message="workers not ready")
    return error_response(request, 503, body, {"Retry-After": "2"})


def _health(request: Request, status: str) -> Health:
    return Health(status=status, service="trainctl", instance=request.app.state.instance_id)
