"""What the step code needs of the ranks, whoever hosts them: ``Group``.

``RankGroup`` (``rank_group.py``) is the service's: one Ray actor per rank. ``LocalGroup`` is
one ``RankWorker`` in this process (``inprocess.py``: the GPU tier and the benchmarks), so
both run the controller's own step sequence (``steps.py``). A call names the unbound
``RankWorker`` method, so its arguments and result are typed through. Imports no Ray and no
torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from trainctl.api import NotReadyError, TrainctlError, WorkerError
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.rank.worker import RankWorker

P = ParamSpec("P")
R = TypeVar("R")


class GroupLostError(NotReadyError):
    """The process group is gone (a rank died or peers are stuck): nothing was applied, and
    the workers must be rebuilt. ``cause`` says what happened, for the recovery record."""

    def __init__(self, message: str, details: Any = None, *, cause: str = "") -> None:
        super().__init__(message, details)
        self.cause = cause or message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_group_lost, (self.message, self.details, self.cause))


def _group_lost(message: str, details: Any, cause: str) -> GroupLostError:
    return GroupLostError(message, details, cause=cause)


class Group(Protocol):
    """Calls on every rank at once."""

    @property
    def cfg(self) -> EngineConfig:
        """The config the ranks run, its layout the current one."""
        ...

    def put(self, value: Any) -> Any:
        """``value`` as the ranks receive it (Ray: one object-store copy for all ranks)."""

    async def call(
        self, method: Callable[Concatenate[RankWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """``method`` (a ``RankWorker`` method) on every rank; the results in rank order."""
        ...

    async def call_quietly(self, method: Callable[..., Any]) -> None:
        """``method`` on every rank that still answers; failures ignored (cleanup)."""


class LocalGroup:
    """A group of one: a ``RankWorker`` in this process, called directly. Owns its one worker."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker

    @property
    def cfg(self) -> EngineConfig:
        return self.worker.shard.cfg

    def put(self, value: Any) -> Any:
        return value

    async def call(
        self, method: Callable[Concatenate[RankWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        try:
            return [method(self.worker, *args, **kwargs)]
        except TrainctlError:
            raise
        except Exception as e:
            raise WorkerError(
                f"rank 0 failed in {method.__name__}: {type(e).__name__}: {e}",
                details={"method": method.__name__},
            ) from e

    async def call_quietly(self, method: Callable[..., Any]) -> None:
        # Cleanup after a failure: that failure is what the caller reports.
        with contextlib.suppress(Exception):
            method(self.worker)
