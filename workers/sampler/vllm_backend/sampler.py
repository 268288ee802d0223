"""vLLM's synchronous engine as an asynchronous ``SamplerEngine``.

``VllmSampler`` runs ``VllmEngine`` on a thread of its own, one call at a time, in the order
``Turns`` gives (``workers/sampler/turns.py``): a load next after the call running, samples in
arrival order. The event loop stays free while a call runs: ``abort`` drops a request still
waiting for its turn (a running one finishes: the synchronous engine cannot stop it), a sample
past its queue timeout leaves with a 503, ``pause`` holds new samples until ``resume``, ``pid``
answers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainctl.api import SampleRequest, SampleResult
from trainctl.workers.sampler.backend import Loaded
from trainctl.workers.sampler.spec import SamplerSpec
from trainctl.workers.sampler.transport import Shipment
from trainctl.workers.sampler.turns import Turns
from trainctl.workers.sampler.vllm_backend.engine import VllmEngine


class VllmSampler:
    """The ``SamplerEngine`` the pool drives: ``VllmEngine`` on a thread of its own, one call at
    a time in ``Turns``' order, with an event loop that stays free to abort, pause and answer.
    Owns the engine, its thread and the turns."""

    def __init__(self, index: int, spec: SamplerSpec) -> None:
        self.index = index
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"sampler-{index}")
        self._engine = self._thread.submit(VllmEngine, index, spec).result()
        self._turns = Turns()

    async def _on_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _load(self, fn: Any, *args: Any) -> Any:
        async with self._turns.load():
            return await self._on_thread(fn, *args)

    async def pid(self) -> int:
        """This engine's process (``info`` shows it; an operator can find it)."""
        return os.getpid()

    async def sample(
        self,
        request_id: str,
        req: SampleRequest,
        version: Shipment,
        queue_timeout_s: float | None = None,
    ) -> SampleResult:
        async with self._turns.sample(request_id, queue_timeout_s):
            result: SampleResult = await self._on_thread(self._engine.sample, req, version)
            return result

    async def abort(self, request_id: str) -> bool:
        """Drop a request still waiting for its turn (True); one running finishes (False)."""
        return await self._turns.abort(request_id)

    async def pause(self) -> None:
        """Hold new samples; returns once the call running (if any) has finished."""
        await self._turns.pause()

    async def resume(self) -> None:
        await self._turns.resume()

    async def load_weights(self, shipment: Shipment) -> Loaded:
        loaded: Loaded = await self._load(self._engine.load_weights, shipment)
        return loaded

    async def load_adapter(self, shipment: Shipment, keep: Sequence[int]) -> Loaded:
        loaded: Loaded = await self._load(self._engine.load_adapter, shipment, keep)
        return loaded

    async def remove_adapter(self, name: str) -> None:
        await self._load(self._engine.remove_adapter, name)
