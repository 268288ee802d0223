"""trainctl's Python SDK. Needs only httpx, pydantic and numpy (no torch, no Ray)."""

from trainctl.api.errors import (
    ConflictError,
    ForbiddenError,
    GoneError,
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
)
from trainctl.clients._base import RetryPolicy
from trainctl.clients.async_ import AsyncTrainctlClient
from trainctl.clients.errors import APIConnectionError
from trainctl.clients.sync import TrainctlClient

__all__ = [
    "APIConnectionError",
    "AsyncTrainctlClient",
    "ConflictError",
    "ForbiddenError",
    "GoneError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "NotReadyError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "RetryPolicy",
    "ServerError",
    "TrainctlClient",
    "TrainctlError",
    "UnauthorizedError",
    "UnsupportedMediaTypeError",
    "WorkerError",
]
