"""Checkpoints and exports: save, load and export (operations), and the list."""

from typing import Annotated

from fastapi import Query

from trainctl.api import CheckpointList
from trainctl.api.adapters import ADAPTER_NAME
from trainctl.service.routes.deps import ControllerDep, resource_router
from trainctl.service.routes.operation_routes import add_operation_routes

router = resource_router("checkpoints")
add_operation_routes(router, "checkpoints")


@router.get("/checkpoints", response_model=CheckpointList)
async def list_checkpoints(
    controller: ControllerDep,
    owner: Annotated[
        str | None,
        Query(pattern=ADAPTER_NAME, description="Whose names (default: the service's own)."),
    ] = None,
) -> CheckpointList:
    """Complete checkpoints of one owner, oldest first."""
    return await controller.list_checkpoints(owner)
