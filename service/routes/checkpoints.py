"""Checkpoints and exports: save, load and export (operations), and the list."""

from trainctl.api import CheckpointList
from trainctl.service.routes.deps import ControllerDep, resource_router
from trainctl.service.routes.operation_routes import add_operation_routes

router = resource_router("checkpoints")
add_operation_routes(router, "checkpoints")


@router.get("/checkpoints", response_model=CheckpointList)
async def list_checkpoints(controller: ControllerDep) -> CheckpointList:
    """Complete checkpoints, oldest first."""
    return await controller.list_checkpoints()
