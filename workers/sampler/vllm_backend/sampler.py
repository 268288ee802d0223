"""vLLM's synchronous engine as an asynchronous ``SamplerEngine``.

``VllmSampler`` runs ``VllmEngine`` on a thread of its own, one call at a time in arrival
order. The event loop stays free while a call runs: ``abort`` drops a request still waiting
for its turn (a running one finishes: the synchronous engine cannot stop it), ``pause`` holds
new samples until ``resume``, ``pid`` answers.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainctl.api import SampleRequest, SampleResult
from trainctl.workers.sampler.backend import Loaded, RequestAbortedError
from trainctl.workers.sampler.spec import SamplerSpec
from trainctl.workers.sampler.transport import Shipment
from trainctl.workers.sampler.vllm_backend.engine import VllmEngine


class VllmSampler:
    """The ``SamplerEngine`` the pool drives: ``VllmEngine`` on a thread of its own, one call at
    a time in arrival order, with an event loop that stays free to abort, pause and answer."""

    def __init__(self, index: int, spec: SamplerSpec) -> None:
        self.index = index
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"sampler-{index}")
        self._engine = self._thread.submit(VllmEngine, index, spec).result()
        self._turn = asyncio.Lock()
        """Held by the engine call running; the others wait for it in arrival order."""
        self._open = asyncio.Event()
        """Set unless paused: a sample waits for it before taking its turn."""
        self._open.set()
        self._waiting: set[str] = set()
        self._aborted: set[str] = set()

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._turn:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def pid(self) -> int:
        """This engine's process (``info`` shows it; an operator can find it)."""
        return os.getpid()

    async def sample(self, request_id: str, req: SampleRequest) -> SampleResult:
        self._waiting.add(request_id)
        try:
            await self._open.wait()
            async with self._turn:
                self._waiting.discard(request_id)
                if request_id in self._aborted:
                    raise RequestAbortedError(
                        f"sampler {self.index}: request {request_id} was aborted before it ran"
                    )
                loop = asyncio.get_running_loop()
                result: SampleResult = await loop.run_in_executor(
                    self._thread, self._engine.sample, req
                )
                return result
        finally:
            self._waiting.discard(request_id)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        """Drop a request still waiting for its turn (True); one running finishes (False)."""
        if request_id not in self._waiting:
            return False
        self._aborted.add(request_id)
        return True

    async def pause(self) -> None:
        """Hold new samples; returns once the call running (if any) has finished."""
        self._open.clear()
        async with self._turn:
            pass

    async def resume(self) -> None:
        self._open.set()

    async def load_weights(self, shipment: Shipment) -> Loaded:
        loaded: Loaded = await self._run(self._engine.load_weights, shipment)
        return loaded

    async def load_adapter(self, shipment: Shipment) -> Loaded:
        loaded: Loaded = await self._run(self._engine.load_adapter, shipment)
        return loaded

    async def remove_adapter(self, name: str) -> None:
        await self._run(self._engine.remove_adapter, name)
