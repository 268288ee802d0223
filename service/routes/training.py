"""``train_batch``, ``eval_batch`` and ``logprobs``: batch operations (``api/operations.py``)."""

from trainctl.service.routes.deps import resource_router
from trainctl.service.routes.operation_routes import add_operation_routes

router = resource_router("training")
add_operation_routes(router, "training")
