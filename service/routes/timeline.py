"""The timeline: every process's recent spans in one Chrome trace (Perfetto opens it)."""

import time
from typing import Any

from fastapi import Request

from trainctl.api import InvalidRequestError
from trainctl.service.routes.deps import ControllerDep, resource_router
from trainctl.service.traces import gather
from trainctl.workers import spans

router = resource_router("timeline")

DEFAULT_WINDOW_S = 60.0
FORMATS = ("chrome",)


@router.get("/timeline")
async def timeline(
    request: Request,
    controller: ControllerDep,
    since: float | None = None,
    until: float | None = None,
    format: str = "chrome",
) -> dict[str, Any]:
    """The spans of the gateway, the controller, every rank and sampler engine that overlap
    ``[since, until]`` (Unix seconds on the gateway's clock; default: the last minute), as
    Chrome trace JSON: open it in https://ui.perfetto.dev. Each process's spans are shifted
    by its clock's offset from the gateway's, measured for this read. Operator only."""
    if format not in FORMATS:
        raise InvalidRequestError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
    until = time.time() if until is None else until
    since = until - DEFAULT_WINDOW_S if since is None else since
    if since > until:
        raise InvalidRequestError(f"since: {since} is after until ({until})")
    kept = spans.ring()
    oldest = kept.oldest() if kept is not None else None
    if oldest is not None and until < oldest - DEFAULT_WINDOW_S:
        raise InvalidRequestError(
            f"until: {until} is before the oldest span the gateway keeps ({oldest:.3f}); "
            "the rings hold recent spans only (--trace-spans)"
        )
    found, dropped = await gather(controller, since, until)
    return spans.chrome_trace(found, dropped=dropped)
