"""The SDK's exceptions: the service's own error classes (``trainctl.api.errors``), raised again
from each 4xx/5xx response by ``error_from``, plus ``APIConnectionError`` when the service
could not be reached. One hierarchy on both sides: ``except NotReadyError`` means the same
thing in a rank, in the gateway and in a client.
"""

from __future__ import annotations

from trainctl.api.errors import (
    ConflictError,
    ErrorType,
    ForbiddenError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    RateLimitedError,
    ServerError,
    TrainctlError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
    WorkerError,
    error_from,
)


class APIConnectionError(TrainctlError):
    """The service could not be reached (refused, reset, timed out): no HTTP status."""

    type = ErrorType.INTERNAL

    @property
    def status(self) -> int:
        return 0

    @property
    def retryable(self) -> bool:
        return True

    def __str__(self) -> str:
        return self.message


__all__ = [
    "APIConnectionError",
    "ConflictError",
    "ForbiddenError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "NotReadyError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "ServerError",
    "TrainctlError",
    "UnauthorizedError",
    "UnsupportedMediaTypeError",
    "WorkerError",
    "error_from",
]
