"""How a Tinker call becomes a native operation: queued on the controller in its model's
``seq_id`` order, idempotent under a key of the model and ``seq_id``, and answered as a
future whose result is the operation's, converted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from trainctl.api import ErrorBody, OperationKind, TrainctlError
from trainctl.api.errors import STATUS_OF, error_from
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.tinker.state import Future, Model, TinkerState

OPERATION_WAIT_S = 30.0
"""How long one poll of a native operation waits for it to finish."""


async def _run_op(controller: ControllerAPI, op_id: str) -> Any:
    """Wait for a native operation; its result, or its error raised."""
    while True:
        op = await controller.operation(op_id, OPERATION_WAIT_S)
        if op.finished:
            break
    if op.error is not None:
        raise _op_error(op.error)
    return op.result


def _op_error(body: ErrorBody) -> TrainctlError:
    return error_from(STATUS_OF[body.type], body.model_dump(mode="json"))


def in_order(
    controller: ControllerAPI,
    state: TinkerState,
    model: Model,
    seq_id: int,
    fingerprint: str,
    kind: OperationKind,
    native: Callable[[], BaseModel],
    result_of: Callable[[Any], Any],
    nbytes: int = 0,
) -> dict[str, Any]:
    """Queue the native request ``native()`` makes in ``model``'s ``seq_id`` order,
    idempotent under its key; the future of its converted result. ``native`` runs in the
    request's turn, so a request it refuses fails its future and passes the turn on."""

    async def admit() -> Awaitable[Any]:
        op = await controller.submit(kind, native(), _key(model, seq_id), fingerprint)

        async def finish() -> Any:
            return result_of(await _run_op(controller, op.id))

        return finish()

    f = state.submit(model, seq_id, fingerprint, kind.value, admit, nbytes)
    return future_of(f, model.model_id)


def _key(model: Model, seq_id: int) -> str:
    """The native idempotency key of a model's request: the controller applies it once."""
    return f"tinker:{model.model_id}:{seq_id}"


def future_of(f: Future, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": f.id, "model_id": model_id}
