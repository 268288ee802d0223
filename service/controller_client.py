"""The gateway's one narrow interface to the controller, and its Ray implementation.

Route tests swap in a fake through ``app.dependency_overrides[get_controller]``; the service
uses ``RayController``, a thin proxy to the named controller actor.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from trainctl.api import (
    AdapterList,
    CheckpointList,
    Info,
    MemoryProfileList,
    MemoryProfileResult,
    ModelLimits,
    NotReadyError,
    Operation,
    OperationKind,
    SampleRequest,
    SampleResult,
    Served,
    TrainctlError,
)
from trainctl.workers import spans
from trainctl.workers.spans import SpanRecord


class ControllerAPI(Protocol):
    async def submit(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Operation: ...
    async def run(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Any: ...
    async def operation(self, op_id: str, wait_s: float = 0.0) -> Operation: ...
    async def list_profiles(self) -> MemoryProfileList: ...
    async def get_profile(self, profile_id: str) -> MemoryProfileResult: ...
    async def read_profile_file(self, profile_id: str, name: str) -> bytes: ...
    async def metrics_text(self) -> bytes: ...
    async def list_checkpoints(self, owner: str | None = None) -> CheckpointList: ...
    async def list_adapters(self) -> AdapterList: ...
    async def inject_fault(self, rank: int, phase: str, times: int, kill: bool = False) -> None: ...
    async def info(self) -> Info: ...
    async def served(self) -> Served: ...
    async def is_ready(self) -> bool: ...
    async def sampler_statuses(self) -> dict[str, int] | None: ...
    async def model_limits(self) -> ModelLimits: ...
    async def clock(self) -> float: ...
    async def timeline(self, since: float, until: float) -> tuple[list[SpanRecord], int]: ...
    async def sample(
        self, req: SampleRequest, queue: bool = False, trace: str | None = None
    ) -> SampleResult:
        """``queue``: past the samplers' admission bound, wait for room (not a 429).
        ``trace``: the caller's ``traceparent``."""
        ...

    async def check_sample_room(self, req: SampleRequest) -> None:
        """A 429 if the samplers hold as much as their bound now (Tinker's ``asample`` asks
        before it answers a future); a 422 if ``req`` alone is above it."""
        ...


class RayController:
    """Proxy to the controller actor; unwraps Ray's error wrapper into trainctl's errors.

    Every method of ``ControllerAPI`` forwards to the actor method of the same name.
    """

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

        ref = getattr(self._actor(), method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            if method in _STOPPED_WITH_THEIR_CALLER:  # the HTTP client left: so does its work
                ray.cancel(ref)
            raise
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, TrainctlError):
                raise cause from None
            raise
        except ray.exceptions.RayActorError as e:
            self._handle = None
            raise NotReadyError(f"the controller is unavailable: {e}") from e

    # An operation joins the trace of the request that asked for it: the gateway's span.
    async def submit(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Operation:
        op: Operation = await self._call(
            "submit", kind, req, key, fingerprint, trace or spans.traceparent()
        )
        return op

    async def run(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Any:
        return await self._call("run", kind, req, key, fingerprint, trace or spans.traceparent())

    async def sample(
        self, req: SampleRequest, queue: bool = False, trace: str | None = None
    ) -> SampleResult:
        result: SampleResult = await self._call("sample", req, queue, trace or spans.traceparent())
        return result

    def __getattr__(self, method: str) -> Any:
        if method not in _METHODS:
            raise AttributeError(method)

        async def call(*args: Any) -> Any:
            return await self._call(method, *args)

        return call


_METHODS = frozenset(name for name in dir(ControllerAPI) if not name.startswith("_"))
_STOPPED_WITH_THEIR_CALLER = frozenset({"sample"})
"""Calls cancelled in the controller when their caller is (Serve cancels a request whose HTTP
client disconnected): a sample then leaves its engine within a step. Training operations are
not: they finish, and a retry with the same key gets their result."""
