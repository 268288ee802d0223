"""Tinker's session trace (``RestClient.export_session_trace``, ``tinker session
export-trace``): the spans of one session's calls, on every process, as a trace Perfetto opens.

The SDK polls ``GET /api/v1/sessions/{id}/trace_export`` until it answers ``ready`` with a
URL, then downloads that URL without credentials. The gateway builds the trace in the poll
itself (a read of the rings: no waiting), so the first poll answers ``ready`` (or ``failed``,
with the reason); the URL carries an unguessable token and expires after an hour
(``service/traces.py``). The trace holds the spans of the traces the session's calls made
(``Session.traces``): the gateway's, the controller's, the ranks' and the engines' spans of
its own operations and samples, and nothing of another session or tenant. Its body is Chrome
trace JSON, which Perfetto's UI reads whatever the file is named (the SDK saves it as
``<session>.pftrace``)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from trainctl.api import NotFoundError, TrainctlError
from trainctl.service.auth import Access, access, tenant_of
from trainctl.service.routes.deps import get_controller
from trainctl.service.shares import party
from trainctl.service.tinker.state import TinkerState
from trainctl.service.traces import TraceExports, gather
from trainctl.workers import spans

router = APIRouter(prefix="/api/v1", include_in_schema=False)


def _exports(request: Request) -> TraceExports:
    value: TraceExports = request.app.state.trace_exports
    return value


@router.get("/sessions/{session_id}/trace_export")
@access(Access.TINKER)
async def trace_export(session_id: str, request: Request) -> dict[str, Any]:
    """The session's trace, built now: ``ready`` with its download URL, or ``failed`` with
    why. Another tenant's session is a 404, as it is everywhere."""
    state: TinkerState = request.app.state.tinker
    s = state.session(session_id, tenant_of(request), finished=True)
    mine = set(s.traces)
    try:
        found, dropped = await gather(get_controller(request), s.started, time.time())
    except TrainctlError as e:
        return {"status": "failed", "error": e.message}
    kept = [r for r in found if r.trace_id in mine]
    body = json.dumps(spans.chrome_trace(kept, dropped=dropped)).encode()
    token = _exports(request).add(body, party(tenant_of(request)))
    return {
        "status": "ready",
        "url": f"{str(request.base_url).rstrip('/')}/api/v1/trace_exports/{token}",
    }


@router.get("/trace_exports/{token}")
@access(Access.OPEN)
async def download(token: str, request: Request) -> Response:
    """A built trace, by the token its URL carries (the URL is the credential)."""
    body = _exports(request).get(token)
    if body is None:
        raise NotFoundError("this trace export does not exist or expired (an hour): export again")
    return Response(body, media_type="application/json")


def install(app: Any) -> None:
    app.state.trace_exports = TraceExports()
    app.include_router(router)
