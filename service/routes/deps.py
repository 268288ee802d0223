"""What every route module shares: the controller, the model's limits and the headers."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.routing import APIRoute

from trainctl.api import API_VERSION, ErrorBody, ModelLimits, Operation
from trainctl.service.controller_client import ControllerAPI

MAX_WAIT_S = 60.0


def get_controller(request: Request) -> ControllerAPI:
    value: ControllerAPI = request.app.state.controller
    return value


ControllerDep = Annotated[ControllerAPI, Depends(get_controller)]


async def get_limits(request: Request, controller: ControllerDep) -> ModelLimits:
    """The model's limits, fetched from the controller once and cached, with the gateway's
    own caps on one request's size."""
    limits: ModelLimits | None = getattr(request.app.state, "limits", None)
    if limits is None:
        model = await controller.model_limits()
        limits = model.model_copy(update=request.app.state.request_caps)
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

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorBody, "description": "Invalid request: the message names the field."},
    503: {"model": ErrorBody, "description": "Workers starting, recovering or shutting down."},
    500: {"model": ErrorBody, "description": "A rank failed; the step was not applied."},
}
OPERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"model": Operation, "description": "Accepted (Prefer: respond-async): poll it."},
    409: {"model": ErrorBody, "description": "Idempotency key reused, or expected_step stale."},
    413: {"model": ErrorBody, "description": "The body exceeds the configured maximum."},
    429: {"model": ErrorBody, "description": "The operation queue is full; see Retry-After."},
}


def _rpc_name(route: APIRoute) -> str:
    """operationId = the route's RPC name (train_batch, start_memory_profile, ...), so that
    generated clients read naturally; FastAPI's default appends the path and method."""
    return route.name


def resource_router(tag: str) -> APIRouter:
    """The router of one resource's routes, under ``/v1``."""
    return APIRouter(
        prefix=f"/{API_VERSION}",
        tags=[tag],
        responses=ERROR_RESPONSES,
        generate_unique_id_function=_rpc_name,
    )
