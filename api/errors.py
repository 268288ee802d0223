"""One error model end to end: workers raise these, the gateway maps them to HTTP, and the SDK
raises the same classes again from the response (``error_from``).

Every error body is ``{"type": ..., "message": ..., "details": ...}``; ``type`` is one of the
``ErrorType`` values and says what kind of change would help. The classes:

    TrainctlError                    .type, .message, .details, .status, .retryable
    ├── InvalidRequestError     422  fix the request; the message names the field
    ├── UnauthorizedError       401
    ├── ForbiddenError          403
    ├── NotFoundError           404
    ├── ConflictError           409  idempotency key reused, stale expected_step, ...
    │   └── CheckpointInvalidError   a checkpoint that does not verify or fit (names the file)
    ├── GoneError               410  it was served, and is no longer kept (a weights step
    │                                past the samplers' window)
    ├── RequestTimeoutError     408  the body did not arrive in time
    ├── PayloadTooLargeError    413
    ├── UnsupportedMediaTypeError 415
    ├── RateLimitedError        429  retry after ``retry_after_s``
    └── ServerError             5xx  nothing was applied
        ├── WorkerError         500  a rank failed the step
        ├── NotReadyError       503  starting, recovering or shutting down
        └── InternalError       500  a bug (or a proxy's 5xx)
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


class ErrorType(str, Enum):
    INVALID_REQUEST = "invalid_request"
    """The request is malformed or violates a model limit; fix the request."""
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    GONE = "gone"
    """What was asked for existed and is no longer kept (a step past the samplers' window)."""
    REQUEST_TIMEOUT = "request_timeout"
    """The request body did not arrive within the gateway's deadline."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMITED = "rate_limited"
    """The operation queue is full; retry after the ``Retry-After`` seconds."""
    NOT_READY = "not_ready"
    """The workers are starting or recovering; retry later."""
    WORKER_ERROR = "worker_error"
    """A rank failed while running the step; the step was not applied."""
    INTERNAL = "internal_error"


STATUS_OF: dict[ErrorType, int] = {
    ErrorType.INVALID_REQUEST: 422,
    ErrorType.UNAUTHORIZED: 401,
    ErrorType.FORBIDDEN: 403,
    ErrorType.NOT_FOUND: 404,
    ErrorType.CONFLICT: 409,
    ErrorType.GONE: 410,
    ErrorType.REQUEST_TIMEOUT: 408,
    ErrorType.PAYLOAD_TOO_LARGE: 413,
    ErrorType.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorType.RATE_LIMITED: 429,
    ErrorType.NOT_READY: 503,
    ErrorType.WORKER_ERROR: 500,
    ErrorType.INTERNAL: 500,
}


class ErrorBody(BaseModel):
    """The JSON body of every 4xx/5xx response."""

    type: ErrorType
    message: str = Field(description="What went wrong and, where possible, what to change.")
    details: Any = Field(default=None, description="Structured context, e.g. the failing field.")


class TrainctlError(Exception):
    """Base of trainctl's domain errors. Carries an ``ErrorType`` and optional details."""

    type: ErrorType = ErrorType.INTERNAL
    retry_after_s: float | None = None
    """Sent as ``Retry-After`` where set (429, 503)."""

    def __init__(
        self,
        message: str,
        details: Any = None,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self._status = status
        if retry_after_s is not None:  # else the class's
            self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        """The HTTP status: the type's, or the one the response carried (SDK side)."""
        return self._status or STATUS_OF[self.type]

    @property
    def retryable(self) -> bool:
        """Nothing was applied and the same request may succeed later (429, 5xx)."""
        return self.status == 429 or self.status >= 500

    def body(self) -> ErrorBody:
        return ErrorBody(type=self.type, message=self.message, details=self.details)

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling through Ray
        args = (type(self), self.message, self.details, self._status, self.retry_after_s)
        return (_rebuild, args)

    def __str__(self) -> str:
        return f"{self.status} {self.type.value}: {self.message}"


class InvalidRequestError(TrainctlError, ValueError):
    """Also a ``ValueError``: a bad value, caught as such by callers and by pydantic (which
    then carries it in its error's context: the gateway unwraps it)."""

    type = ErrorType.INVALID_REQUEST


class NotFoundError(TrainctlError):
    type = ErrorType.NOT_FOUND


class ConflictError(TrainctlError):
    type = ErrorType.CONFLICT


class CheckpointInvalidError(ConflictError):
    """A checkpoint's files do not prove the content its manifest names (changed, mixed with
    another save's, unreadable, non-finite) or do not fit this model; ``details`` name the
    checkpoint, the file and why. Nothing was loaded."""


class GoneError(TrainctlError):
    type = ErrorType.GONE


class PayloadTooLargeError(TrainctlError):
    type = ErrorType.PAYLOAD_TOO_LARGE


class RequestTimeoutError(TrainctlError):
    type = ErrorType.REQUEST_TIMEOUT


class UnsupportedMediaTypeError(TrainctlError):
    type = ErrorType.UNSUPPORTED_MEDIA_TYPE


class UnauthorizedError(TrainctlError):
    type = ErrorType.UNAUTHORIZED


class ForbiddenError(TrainctlError):
    type = ErrorType.FORBIDDEN


class RateLimitedError(TrainctlError):
    type = ErrorType.RATE_LIMITED
    retry_after_s = 1.0


class ServerError(TrainctlError):
    """A 5xx: the service could not do it; nothing was applied, and a retry may succeed."""

    type = ErrorType.INTERNAL


class NotReadyError(ServerError):
    type = ErrorType.NOT_READY
    retry_after_s = 2.0


class WorkerError(ServerError):
    type = ErrorType.WORKER_ERROR


class InternalError(ServerError):
    type = ErrorType.INTERNAL


def _rebuild(
    cls: type[TrainctlError],
    message: str,
    details: Any,
    status: int | None,
    retry_after_s: float | None = None,
) -> TrainctlError:
    return cls(message, details, status=status, retry_after_s=retry_after_s)


ERROR_CLASSES: dict[ErrorType, type[TrainctlError]] = {
    c.type: c
    for c in (
        InvalidRequestError, UnauthorizedError, ForbiddenError, NotFoundError, ConflictError,
        GoneError,
        PayloadTooLargeError, RequestTimeoutError, UnsupportedMediaTypeError,
        RateLimitedError, NotReadyError,
        WorkerError, InternalError,
    )
}  # fmt: skip


_CLASS_OF_STATUS = {STATUS_OF[t]: c for t, c in ERROR_CLASSES.items()}  # 500: InternalError


def error_from(status: int, body: Any) -> TrainctlError:
    """The error of a 4xx/5xx response whose body is ``body``: the class of its ``type`` where
    that type answers with this status, else the class of the status (a body from something
    in between, e.g. a proxy, or a type that disagrees with the status)."""
    typed = isinstance(body, dict) and body.get("type") in ErrorType._value2member_map_
    cls = _CLASS_OF_STATUS.get(status, InternalError if status >= 500 else InvalidRequestError)
    if typed and STATUS_OF[ErrorType(body["type"])] == status:
        cls = ERROR_CLASSES[ErrorType(body["type"])]
    if isinstance(body, dict):
        message, details = str(body.get("message") or body), body.get("details")
    else:
        message, details = str(body)[:2000], None
    return cls(message, details, status=status)


def field_error(field: str, problem: str, sep: str = ": ") -> InvalidRequestError:
    """An ``InvalidRequestError`` naming the field (``sequences[2].tokens[7]``) and the problem;
    its message is the two joined by ``sep`` (" " where the problem reads on from the field:
    ``sequences[0].advantages is required by the ppo loss``)."""
    details = {"field": field, "problem": problem}
    return InvalidRequestError(f"{field}{sep}{problem}", details=details)


def raised_inside(err: Mapping[str, Any]) -> TrainctlError | None:
    """The ``TrainctlError`` our own check raised inside pydantic, if that is what this entry
    of a ``ValidationError`` is (pydantic keeps it as ``ctx["error"]``)."""
    ctx = err.get("ctx")
    raised = ctx.get("error") if isinstance(ctx, Mapping) else None
    return raised if isinstance(raised, TrainctlError) else None


def validation_problem(err: Mapping[str, Any]) -> str:
    """One entry of a pydantic ``ValidationError`` in plain words: a ``TrainctlError`` raised by
    our own check inside pydantic gives its message (it names its field); anything else,
    pydantic's text without its "Value error, " prefix."""
    if (raised := raised_inside(err)) is not None:
        return raised.message
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")
