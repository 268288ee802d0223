"""The SDK's one exception of its own, ``APIConnectionError``: the service could not be
reached. Every 4xx/5xx is raised as the service's own error class (``trainctl.api.errors``,
re-exported by ``trainctl.clients``), rebuilt from the response by ``error_from``. One
hierarchy on both sides: ``except NotReadyError`` means the same thing in a rank, in the
gateway and in a client.
"""

from __future__ import annotations

from trainctl.api.errors import ErrorType, TrainctlError


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
