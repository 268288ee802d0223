"""trainctl's Python SDK. Needs only httpx, pydantic and numpy (no torch, no Ray)."""

from trainctl.clients._base import RetryPolicy
from trainctl.clients.async_ import AsyncTrainctlClient
from trainctl.clients.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    TrainctlClientError,
)
from trainctl.clients.sync import TrainctlClient

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncTrainctlClient",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "RetryPolicy",
    "ServiceUnavailableError",
    "TrainctlClient",
    "TrainctlClientError",
]
