"""``POST /v1/sample`` (the sampler engines, beside training) and ``POST /v1/weights/sync``
(an operation: queued with the training calls, ``api/operations.py``)."""

from fastapi import Request

from trainctl.api import ErrorBody, SampleRequest, SampleResult
from trainctl.service.codec import read_body
from trainctl.service.routes.deps import ControllerDep, LimitsDep, resource_router
from trainctl.service.routes.operation_routes import add_operation_routes

router = resource_router("sampling")
add_operation_routes(router, "sampling")


@router.post(
    "/sample",
    response_model=SampleResult,
    responses={
        409: {
            "model": ErrorBody,
            "description": "`step` not synced yet, or `expected_step` "
            "names another version; or a service without samplers.",
        },
        410: {
            "model": ErrorBody,
            "description": "`step` has left the samplers' window "
            "(--sampler-versions); the message names the oldest step served.",
        },
        429: {
            "model": ErrorBody,
            "description": "The samplers hold their admission bound; see Retry-After.",
        },
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/SampleRequest"}}
            },
        }
    },
)
async def sample(request: Request, controller: ControllerDep, limits: LimitsDep) -> SampleResult:
    """Generate completions of token-id prompts with the samplers' weights (the newest
    version, or `step`'s), on the least loaded sampler engine; the result names the optimizer
    step of those weights."""
    body = await read_body(request, request.app.state.max_body_bytes)
    req = SampleRequest.model_validate_json(body)
    req.check_limits(limits)
    return await controller.sample(req)
