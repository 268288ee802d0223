"""One error model end to end: workers raise these, the gateway maps them to HTTP, the SDK back.

Every error body is ``{"type": ..., "message": ..., "details": ...}``; ``type`` is one of the
``ErrorType`` values and says what kind of change would help.
"""

from __future__ import annotations

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

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def status(self) -> int:
        return STATUS_OF[self.type]

    @property
    def retryable(self) -> bool:
        """Nothing was applied and the same request may succeed later (429, 5xx)."""
        return self.status == 429 or self.status >= 500

    def body(self) -> ErrorBody:
        return ErrorBody(type=self.type, message=self.message, details=self.details)

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling through Ray
        return (type(self), (self.message, self.details))


class InvalidRequestError(TrainctlError):
    type = ErrorType.INVALID_REQUEST


class NotFoundError(TrainctlError):
    type = ErrorType.NOT_FOUND


class ConflictError(TrainctlError):
    type = ErrorType.CONFLICT


class PayloadTooLargeError(TrainctlError):
    type = ErrorType.PAYLOAD_TOO_LARGE


class UnsupportedMediaTypeError(TrainctlError):
    type = ErrorType.UNSUPPORTED_MEDIA_TYPE


class RateLimitedError(TrainctlError):
    type = ErrorType.RATE_LIMITED
    retry_after_s = 1.0


class NotReadyError(TrainctlError):
    type = ErrorType.NOT_READY
    retry_after_s = 2.0


class WorkerError(TrainctlError):
    type = ErrorType.WORKER_ERROR


def field_error(field: str, problem: str) -> InvalidRequestError:
    """An ``InvalidRequestError`` naming the field (``sequences[2].tokens[7]``) and the problem."""
    return InvalidRequestError(f"{field}: {problem}", details={"field": field, "problem": problem})
