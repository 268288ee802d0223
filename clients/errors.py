"""Exceptions of the SDK: one class per HTTP status family, each carrying the error body."""

from __future__ import annotations

from typing import Any


class TrainctlClientError(Exception):
    """Base of every SDK error."""


class APIConnectionError(TrainctlClientError):
    """The service could not be reached (refused, reset, timed out)."""


class APIStatusError(TrainctlClientError):
    """The service answered with a 4xx/5xx; ``type``, ``message``, ``details`` from its body."""

    def __init__(self, status: int, type: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message, self.details = status, type, message, details


class BadRequestError(APIStatusError):
    """400/422: the request is invalid; the message names the field and the problem."""


class AuthenticationError(APIStatusError):
    """401: no or malformed credentials."""


class PermissionDeniedError(APIStatusError):
    """403: wrong credentials."""


class NotFoundError(APIStatusError):
    """404."""


class ConflictError(APIStatusError):
    """409: the request conflicts with the service's state (e.g. a profile already running)."""


class PayloadTooLargeError(APIStatusError):
    """413: the body exceeds the service's limit."""


class RateLimitError(APIStatusError):
    """429: the queue is full; retry later."""


class InternalServerError(APIStatusError):
    """5xx: the service or a rank failed; a failed step is not applied."""


class ServiceUnavailableError(InternalServerError):
    """503: workers starting, recovering or shutting down; retryable."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    415: BadRequestError,
    422: BadRequestError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def error_for(status: int, body: Any) -> APIStatusError:
    """The exception for a non-2xx response with JSON ``body`` (or raw text)."""
    if isinstance(body, dict):
        type_ = str(body.get("type", "error"))
        message = str(body.get("message") or body.get("detail") or body)
        details = body.get("details")
    else:
        type_, message, details = "error", str(body)[:2000], None
    cls = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return cls(status, type_, message, details)
