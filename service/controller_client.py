"""The gateway's one narrow interface to the controller, and its Ray implementation.

Route tests swap in a fake through ``app.dependency_overrides[get_controller]``; the service
uses ``RayController``, a thin proxy to the named controller actor.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainctl.api import (
    EvalBatchRequest,
    Info,
    MemoryProfileResult,
    MemoryProfileStarted,
    ModelLimits,
    NotReadyError,
    StepResult,
    TrainBatchRequest,
    TrainctlError,
)


class ControllerAPI(Protocol):
    async def train_batch(self, req: TrainBatchRequest) -> StepResult: ...
    async def eval_batch(self, req: EvalBatchRequest) -> StepResult: ...
    async def start_memory_profile(self, max_entries: int) -> MemoryProfileStarted: ...
    async def stop_memory_profile(self) -> MemoryProfileResult: ...
    async def info(self) -> Info: ...
    async def is_ready(self) -> bool: ...
    async def model_limits(self) -> ModelLimits: ...


class RayController:
    """Proxy to the controller actor; unwraps Ray's error wrapper into trainctl's errors."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace
        self._handle: Any = None

    def _actor(self) -> Any:
        import ray

        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError as e:
                raise NotReadyError(f"controller actor {self.name!r} is not running") from e
        return self._handle

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self._actor(), method).remote(*args)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, TrainctlError):
                raise cause from None
            raise
        except ray.exceptions.RayActorError as e:
            self._handle = None
            raise NotReadyError(f"the controller is unavailable: {e}") from e

    async def train_batch(self, req: TrainBatchRequest) -> StepResult:
        return await self._call("train_batch", req)  # type: ignore[no-any-return]

    async def eval_batch(self, req: EvalBatchRequest) -> StepResult:
        return await self._call("eval_batch", req)  # type: ignore[no-any-return]

    async def start_memory_profile(self, max_entries: int) -> MemoryProfileStarted:
        return await self._call("start_memory_profile", max_entries)  # type: ignore[no-any-return]

    async def stop_memory_profile(self) -> MemoryProfileResult:
        return await self._call("stop_memory_profile")  # type: ignore[no-any-return]

    async def info(self) -> Info:
        return await self._call("info")  # type: ignore[no-any-return]

    async def is_ready(self) -> bool:
        return bool(await self._call("is_ready"))

    async def model_limits(self) -> ModelLimits:
        return await self._call("model_limits")  # type: ignore[no-any-return]
