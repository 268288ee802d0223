"""Whose turn it is on a sampler engine.

Samples take their turns in arrival order. Samples of one *lane* (the same weights: one
version of the base, or one version of an adapter) share the engine: the one at the head of
the queue joins those running when it is of their lane and fewer than ``capacity`` run; a
sample of another lane waits until they have finished, and so does every sample behind it (no
lane starves another). A sample with no lane runs alone.

A weight or adapter load goes next, ahead of every sample still waiting: a sync waits for the
samples running, never behind the queue (thousands can be waiting). A load may name a lane it
runs beside: then it waits for no sample of that lane (an in-flight weight update). A waiting
sample can be aborted, and one that has waited its queue timeout leaves the queue with a
retryable 503 instead of running late; neither ever reaches the engine. ``pause`` holds
samples (not loads) from their turn until ``resume``.

Backend-free: it orders coroutines, and knows nothing of what the turn runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Any

from trainctl.workers.sampler.backend import QueueTimeoutError, RequestAbortedError


class Turns:
    """The order of calls on one engine. Owns the queue of waiting samples and loads, the
    samples running and their lane, the load running, the pause, and the aborted requests."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        """How many samples of one lane may run at once."""
        self._changed = asyncio.Condition()
        self._running: set[str] = set()
        self._lane: Hashable | None = None
        """The lane of the samples running (None: they run alone, or none runs)."""
        self._loading = False
        self._samples: deque[str] = deque()
        """Waiting samples' request ids, in arrival order."""
        self._loads: deque[object] = deque()
        """Waiting loads, in arrival order."""
        self._aborted: set[str] = set()

    @property
    def waiting(self) -> int:
        return len(self._samples) + len(self._loads)

    @property
    def running(self) -> frozenset[str]:
        """The samples holding a turn now."""
        return frozenset(self._running)

    def _joins(self, lane: Hashable | None) -> bool:
        """Whether a sample of ``lane`` may run beside the samples running now."""
        if not self._running:
            return not self._loading
        return lane is not None and lane == self._lane and len(self._running) < self.capacity

    @asynccontextmanager
    async def sample(
        self, request_id: str, queue_timeout_s: float | None = None, lane: Hashable | None = None
    ) -> AsyncIterator[None]:
        """Hold a turn for the sample ``request_id`` (after the loads and earlier samples;
        beside running samples of its ``lane``); past ``queue_timeout_s`` of waiting,
        ``QueueTimeoutError``."""
        deadline = None if queue_timeout_s is None else time.monotonic() + queue_timeout_s
        self._samples.append(request_id)
        try:
            async with self._changed:
                while not (
                    request_id in self._aborted
                    or (not self._loads and self._samples[0] == request_id
                        and self._joins(lane))
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
                self._running.add(request_id)
                self._lane = lane
        except BaseException:
            self._aborted.discard(request_id)
            await self._leave(self._samples, request_id)
            raise
        try:
            yield
        finally:
            self._running.discard(request_id)
            if not self._running:
                self._lane = None
            await self._notify()

    @asynccontextmanager
    async def load(self, beside: Hashable | None = None) -> AsyncIterator[None]:
        """Hold the turn for a load: next after the samples running, before any waiting one.
        ``beside``: a lane whose running samples the load need not wait for (they go on
        with what it loads: an in-flight weight update)."""
        me = object()
        self._loads.append(me)

        def waits() -> bool:
            busy = self._running and (beside is None or self._lane != beside)
            return bool(busy) or self._loading or self._loads[0] is not me

        try:
            async with self._changed:
                while waits():
                    await self._changed.wait()
                self._loads.popleft()
                self._loading = True
        except BaseException:
            await self._leave(self._loads, me)
            raise
        try:
            yield
        finally:
            self._loading = False
            await self._notify()

    async def abort(self, request_id: str) -> bool:
        """Drop a sample still waiting (True); one that holds its turn is the engine's to stop
        (False)."""
        if request_id not in self._samples:
            return False
        self._aborted.add(request_id)
        await self._notify()
        return True

    async def _leave(self, queue: deque[Any], item: object) -> None:
        """``item`` gives up its place in ``queue`` (it timed out, was aborted or cancelled)."""
        if item in queue:
            queue.remove(item)
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
