"""Checkpoints and exports: save, load and export (operations), the list, and deletes."""

from typing import Annotated

from fastapi import Path, Query, Request, Response

from trainctl.api import CheckpointList, DeleteCheckpointRequest, Deleted, OperationKind
from trainctl.api.adapters import ADAPTER_NAME
from trainctl.api.operations import fingerprint
from trainctl.service.routes.deps import (
    OPERATION_RESPONSES,
    ControllerDep,
    IdempotencyKey,
    Prefer,
    resource_router,
)
from trainctl.service.routes.operation_routes import add_operation_routes, dispatch

router = resource_router("checkpoints")
add_operation_routes(router, "checkpoints")

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
DELETE = OperationKind.DELETE_CHECKPOINT
Owner = Annotated[
    str | None,
    Query(pattern=ADAPTER_NAME, description="Whose names (default: the service's own)."),
]


@router.get("/checkpoints", response_model=CheckpointList)
async def list_checkpoints(controller: ControllerDep, owner: Owner = None) -> CheckpointList:
    """Complete checkpoints of one owner, oldest first."""
    return await controller.list_checkpoints(owner)


@router.delete(
    "/checkpoints/{checkpoint_id}", response_model=Deleted, responses=OPERATION_RESPONSES
)
async def delete_checkpoint(
    request: Request,
    controller: ControllerDep,
    checkpoint_id: str = Path(pattern=NAME),
    owner: Owner = None,
    idempotency_key: IdempotencyKey = None,
    prefer: Prefer = None,
) -> Response:
    """Delete one owner's checkpoint from disk, in the operation queue's turn (never under a
    load that reads it); 404 if it does not exist."""
    req = DeleteCheckpointRequest(checkpoint_id=checkpoint_id, owner=owner)
    return await dispatch(request, controller, DELETE, req, idempotency_key, fingerprint(req),
                          prefer)  # fmt: skip


@router.delete("/exports/{name}", response_model=Deleted, responses=OPERATION_RESPONSES)
async def delete_export(
    request: Request,
    controller: ControllerDep,
    name: str = Path(pattern=NAME),
    owner: Owner = None,
    idempotency_key: IdempotencyKey = None,
    prefer: Prefer = None,
) -> Response:
    """Delete one owner's Hugging Face export from disk, in the operation queue's turn."""
    req = DeleteCheckpointRequest(checkpoint_id=name, owner=owner, export=True)
    return await dispatch(request, controller, DELETE, req, idempotency_key, fingerprint(req),
                          prefer)  # fmt: skip
