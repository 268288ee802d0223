"""Operation routes, made from the one table (``api/operations.py``), and their polling.

Every operation answers its result when done, or (``Prefer: respond-async``) 202 at once with
the operation to poll at ``GET /v1/operations/{id}``; ``Idempotency-Key`` makes it safe to
retry. A batch body is JSON or the binary frame (``api/wire.py``); the others are JSON.
"""

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from trainctl.api import API_VERSION, Operation, OperationKind, OperationSpec, wire
from trainctl.api.errors import STATUS_OF, field_error
from trainctl.api.operations import ROUTED, fingerprint
from trainctl.service.codec import decode_request, encode_response, read_body
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.errors import public
from trainctl.service.metrics import GatewayMetrics
from trainctl.service.routes.deps import (
    MAX_WAIT_S,
    OPERATION_RESPONSES,
    ControllerDep,
    IdempotencyKey,
    LimitsDep,
    Prefer,
    resource_router,
)
from trainctl.workers import spans

log = logging.getLogger(__name__)


async def dispatch(
    request: Request,
    controller: ControllerAPI,
    kind: OperationKind,
    req: BaseModel,
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
    with spans.span("wait"):  # for the operation: its queue and run (the controller's spans)
        result = await controller.run(kind, req, key, fingerprint)
    return encode_response(request, result)


async def _read(request: Request, spec: OperationSpec, limits: Any) -> tuple[BaseModel, str]:
    """The request of ``spec`` and its idempotency fingerprint."""
    max_bytes = request.app.state.max_body_bytes
    if spec.batch:
        decoded = await decode_request(request, spec.request, max_bytes)
        metrics: GatewayMetrics = request.app.state.metrics
        encoding = "binary" if "tensors" in request.headers.get("content-type", "") else "json"
        metrics.request_bytes.labels(encoding).inc(decoded.nbytes)
        decoded.model.check_limits(limits)
        return decoded.model, decoded.fingerprint
    body = await read_body(request, max_bytes)
    with spans.span("validate"):
        return _validated(spec, body, dict(request.path_params))


def _validated(spec: OperationSpec, body: bytes, fields: dict[str, Any]) -> tuple[BaseModel, str]:
    if body.strip() and fields:  # the path's fields complete (and win over) the body's
        try:
            raw = json.loads(body)
        except ValueError as e:
            raise field_error("body", f"is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise field_error("body", "must be a JSON object")
        req = spec.request.model_validate({**raw, **fields})
    elif body.strip():
        req = spec.request.model_validate_json(body)
    else:
        req = spec.request.model_validate(fields)
    return req, fingerprint(req)


def _body_doc(spec: OperationSpec) -> dict[str, Any]:
    """OpenAPI request body: the model as JSON, and for batches the binary frame too."""
    ref = {"schema": {"$ref": f"#/components/schemas/{spec.request.__name__}"}}
    content: dict[str, Any] = {wire.JSON_CONTENT_TYPE: ref}
    if spec.batch:
        content[wire.CONTENT_TYPE] = {"schema": {"type": "string", "format": "binary"}}
    doc: dict[str, Any] = {"requestBody": {"required": spec.batch, "content": content}}
    params = [p.strip("{}") for p in spec.path.split("/") if p.startswith("{")]
    if params:
        doc["parameters"] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in params
        ]
    if not set(spec.request.model_fields) - set(params):
        del doc["requestBody"]
    return doc


def add_operation_route(r: APIRouter, spec: OperationSpec) -> None:
    """``POST /v1{spec.path}`` running ``spec.kind``; its operationId is the kind."""

    async def endpoint(
        request: Request,
        controller: ControllerDep,
        limits: LimitsDep,
        idempotency_key: IdempotencyKey = None,
        prefer: Prefer = None,
    ) -> Response:
        req, fingerprint = await _read(request, spec, limits)
        return await dispatch(
            request, controller, spec.kind, req, idempotency_key, fingerprint, prefer
        )

    r.add_api_route(
        spec.path,
        endpoint,
        methods=["POST"],
        name=spec.kind.value,
        description=spec.summary,
        response_model=spec.result,
        openapi_extra=_body_doc(spec),
        tags=[spec.tag],
        responses=OPERATION_RESPONSES,
    )


def add_operation_routes(r: APIRouter, tag: str) -> None:
    """A route for every operation of the table tagged ``tag``."""
    for spec in ROUTED:
        if spec.tag == tag:
            add_operation_route(r, spec)


router = resource_router("training")


@router.get("/operations/{op_id}", response_model=Operation)
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
    op = await controller.operation(op_id, wait)
    if op.error is not None and STATUS_OF[op.error.type] >= 500:
        op.error = public(op.error)
    return encode_response(request, op)
