"""LoRA adapters: create (an operation), list, delete."""

from fastapi import Path, Request, Response

from trainctl.api import AdapterList, DeleteAdapterRequest, OperationKind
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

router = resource_router("adapters")
add_operation_routes(router, "adapters")


@router.get("/adapters", response_model=AdapterList)
async def list_adapters(controller: ControllerDep) -> AdapterList:
    """The adapters on this service's base: rank, alpha, targets, step, bytes, last use."""
    return await controller.list_adapters()


@router.delete("/adapters/{name}", response_model=AdapterList, responses=OPERATION_RESPONSES)
async def delete_adapter(
    request: Request,
    controller: ControllerDep,
    name: str = Path(pattern=ADAPTER_NAME),
    idempotency_key: IdempotencyKey = None,
    prefer: Prefer = None,
) -> Response:
    """Delete an adapter (its weights, AdamW state and any waiting gradients), in the
    operation queue's turn; the adapters left."""
    req = DeleteAdapterRequest(name=name)
    return await dispatch(
        request, controller, OperationKind.DELETE_ADAPTER, req, idempotency_key, fingerprint(req),
        prefer,
    )  # fmt: skip
