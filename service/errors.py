"""The gateway's error bodies: every 4xx/5xx is ``{"type", "message", "details"}``.

A validation error names the field (``sequences[0].tokens[3]: ...``); a ``TrainctlError`` keeps
its type, message and ``Retry-After``; the router's own 404/405 and anything unexpected get
the same shape.
"""

import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainctl.api import ErrorBody, ErrorType, TrainctlError
from trainctl.api.errors import raised_inside, validation_problem
from trainctl.service.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def _loc(loc: tuple[Any, ...]) -> str:
    """``('body', 'sequences', 0, 'tokens', 3)`` -> ``sequences[0].tokens[3]``."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "header", "query", "path") else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


_IP = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")
_PID = re.compile(r"\bpid=\d+")
_PATH = re.compile(r"(?<![\w:/])/(?:[\w.@+-]+/)+[\w.@+-]*")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_HEX = re.compile(r"\b(?:0x[0-9a-fA-F]{6,}|[0-9a-fA-F]{24,})\b")
"""Heap addresses (``0x7f33...``) and Ray's actor, task and node ids (hex, 24+ digits; a Tinker
session id, 16, stays: the caller needs it)."""
_PUBLIC_DETAILS = {"ranks", "method", "queued", "accumulated_parts", "operation"}


def _scrubbed(text: str) -> str:
    """``text`` without colour codes, addresses, pids, ids or file paths."""
    text = _ANSI.sub("", text)
    text = _IP.sub("<address>", text)
    text = _PID.sub("pid=<pid>", text)
    return _PATH.sub("<path>", _HEX.sub("<id>", text))


def _public_value(value: Any) -> Any:
    """A detail's value with every string in it scrubbed, and only its first line kept."""
    if isinstance(value, str):
        return _scrubbed(value.strip().splitlines()[0] if value.strip() else "")[:500]
    if isinstance(value, dict):
        return {str(k): _public_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_public_value(v) for v in value]
    return value


def public(body: ErrorBody) -> ErrorBody:
    """A server error as a client may see it: the first line of its message and of each kept
    detail, without colour codes, addresses, pids, ids or file paths; no remote tracebacks in
    its details; and an ``error_id``
    that finds the whole story in the service log (logged here)."""
    error_id = uuid.uuid4().hex[:12]
    log.error("error %s: %s %s (details: %s)", error_id, body.type.value, body.message,
              body.details)  # fmt: skip
    message = _public_value(body.message) or body.type.value
    kept = body.details if isinstance(body.details, dict) else {}
    details = {k: _public_value(v) for k, v in kept.items() if k in _PUBLIC_DETAILS}
    return ErrorBody(type=body.type, message=message, details={**details, "error_id": error_id})


def error_response(
    request: Request, status: int, body: ErrorBody, headers: dict[str, str] | None = None
) -> JSONResponse:
    metrics: GatewayMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.errors.labels(body.type.value).inc()
    if status >= 500:
        body = public(body)
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"), headers=headers)


def _validation_error(request: Request, errors: list[Any]) -> JSONResponse:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if (raised := raised_inside(first)) is not None:  # our own check: it names its field
        return error_response(request, raised.status, raised.body())
    field = _loc(tuple(first.get("loc", ())))
    msg = validation_problem(first)
    details = [
        {"field": _loc(tuple(e.get("loc", ()))), "problem": validation_problem(e),
         "type": e.get("type")}
        for e in errors[:20]
    ]  # fmt: skip
    # A model-level check names its field in the message itself; a malformed body does not.
    model_check = field == "body" and first.get("type") == "value_error"
    message = msg if model_check else f"{field}: {msg}"
    body = ErrorBody(type=ErrorType.INVALID_REQUEST, message=message, details=details)
    return error_response(request, 422, body)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(request, list(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _model_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return _validation_error(request, list(exc.errors(include_url=False)))

    @app.exception_handler(TrainctlError)
    async def _domain(request: Request, exc: TrainctlError) -> JSONResponse:
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return error_response(request, exc.status, exc.body(), headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(request, exc.status_code, ErrorBody(type=kind, message=message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        body = ErrorBody(type=ErrorType.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        return error_response(request, 500, body)
