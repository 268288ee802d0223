"""Whose turn it is on an engine that runs one call at a time.

A weight or adapter load goes next, ahead of every sample still waiting: a sync waits at most
for the call running, never behind the queue (hundreds of samples can be waiting). Samples
take their turns in arrival order. A waiting sample can be aborted, and one that has waited its
queue timeout leaves the queue with a retryable 503 instead of running late; neither ever
reaches the engine. ``pause`` holds samples (not loads) from their next turn until
``resume``.

Backend-free: it orders coroutines, and knows nothing of what the turn runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from trainctl.workers.sampler.backend import QueueTimeoutError, RequestAbortedError


class Turns:
    """The order of calls on one engine. Owns the queue of waiting samples and loads, which
    call holds the turn, the pause, and the aborted requests."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._busy = False
        self._open = True
        self._samples: deque[str] = deque()
        """Waiting samples' request ids, in arrival order."""
        self._loads: deque[object] = deque()
        """Waiting loads, in arrival order."""
        self._aborted: set[str] = set()

    @property
    def waiting(self) -> int:
        return len(self._samples) + len(self._loads)

    @asynccontextmanager
    async def sample(
        self, request_id: str, queue_timeout_s: float | None = None
    ) -> AsyncIterator[None]:
        """Hold the turn for the sample ``request_id`` (after the loads and earlier samples);
        past ``queue_timeout_s`` of waiting, ``QueueTimeoutError``."""
        deadline = None if queue_timeout_s is None else time.monotonic() + queue_timeout_s
        self._samples.append(request_id)
        try:
            async with self._changed:
                while not (
                    request_id in self._aborted
                    or (self._open and not self._busy and not self._loads
                        and self._samples[0] == request_id)
                ):  # fmt: skip
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise QueueTimeoutError(
                            f"request {request_id} waited {queue_timeout_s:g} s for the "
                            f"engine behind {self.waiting - 1} other call(s) and did not run: "
                            "retry (--sampler-queue-timeout-s)"
                        )
                    try:
                        await asyncio.wait_for(self._changed.wait(), left)
                    except TimeoutError:
                        continue  # the loop raises QueueTimeoutError
                if request_id in self._aborted:
                    raise RequestAbortedError(f"request {request_id} was aborted before it ran")
                self._samples.popleft()
                self._busy = True
        except BaseException:
            self._aborted.discard(request_id)
            await self._leave(self._samples, request_id)
            raise
        try:
            yield
        finally:
            await self._release()

    @asynccontextmanager
    async def load(self) -> AsyncIterator[None]:
        """Hold the turn for a load: next after the call running, before any waiting sample."""
        me = object()
        self._loads.append(me)
        try:
            async with self._changed:
                while self._busy or self._loads[0] is not me:
                    await self._changed.wait()
                self._loads.popleft()
                self._busy = True
        except BaseException:
            await self._leave(self._loads, me)
            raise
        try:
            yield
        finally:
            await self._release()

    async def abort(self, request_id: str) -> bool:
        """Drop a sample still waiting (True); one that holds its turn finishes (False)."""
        if request_id not in self._samples:
            return False
        self._aborted.add(request_id)
        await self._notify()
        return True

    async def pause(self) -> None:
        """Hold samples from their next turn; returns once the call running has finished."""
        self._open = False
        async with self._changed:
            while self._busy:
                await self._changed.wait()

    async def resume(self) -> None:
        self._open = True
        await self._notify()

    async def _leave(self, queue: deque[Any], item: object) -> None:
        """``item`` gives up its place in ``queue`` (it timed out, was aborted or cancelled)."""
        if item in queue:
            queue.remove(item)
        await self._notify()

    async def _release(self) -> None:
        self._busy = False
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
