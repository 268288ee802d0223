"""vLLM's engine as an asynchronous ``SamplerEngine``: many requests at once.

``VllmSampler`` drives ``VllmEngine`` (vLLM's ``LLMEngine``, in this process) on a thread of
its own, one engine step at a time: every request running advances by a token (or finishes its
prompt) per step, and between two steps the thread adds the requests whose turn came and drops
the aborted ones. ``Turns`` (``workers/sampler/turns.py``) says whose turn it is: requests of one
version of the base share the engine, and so do the requests of any adapters (each names its
adapter's version, which vLLM applies per request), up to ``SamplerSpec.concurrency`` (vLLM
schedules their prompts within its ``max_num_seqs``); a request of another lane waits until
they are done, and a load goes next after them, ahead of every waiting request. So a result is
always one version's, and base and adapter requests never share an engine batch.

With in-flight updates (``SamplerSpec.in_flight``, ``--sampler-sync in_flight``) the requests
for the newest weights of the base share one lane across versions, and a weight load runs
beside them, between two engine steps: they go on with the new weights (``VllmEngine`` has
vLLM recompute their prefixes), and each token's step is in ``Completion.token_steps``. So do
the requests for the adapters' newest versions, on each adapter's newest slot, beside which an
adapter's sync runs. A request pinned to a step still waits for its own version.

The event loop stays free meanwhile: ``abort`` drops a waiting request at once and a running
one at the next step boundary (a step takes milliseconds), a sample past its queue timeout
leaves with a 503, ``pause`` holds new samples until ``resume``, ``pid`` answers.

A request for prompt log-probs on an engine with LoRA enabled runs alone, as one call
(``VllmEngine.sample``): vLLM 0.32's LoRA LM head fails prompt log-probs for several requests in
one step (``engine.py``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainctl.api import SampleRequest, SampleResult
from trainctl.workers import spans
from trainctl.workers.sampler.backend import Loaded, RequestAbortedError
from trainctl.workers.sampler.spec import SamplerSpec
from trainctl.workers.sampler.transport import Shipment
from trainctl.workers.sampler.turns import Turns
from trainctl.workers.sampler.vllm_backend.engine import VllmEngine


@dataclass
class _Running:
    """One request's prompts in the engine, and their outputs as they finish."""

    ids: list[str]
    done: asyncio.Future[list[Any]]
    admitted: float
    """When its prompts entered the engine (wall clock)."""
    outs: dict[str, Any] = field(default_factory=dict)
    first_step: float | None = None
    """When the first engine step after its admission ended: its prompts computed (the
    prefill, with its first token), from then on one token per step (the decode)."""

    def finished(self, out: Any) -> None:
        self.outs[out.request_id] = out
        if len(self.outs) == len(self.ids) and not self.done.done():
            self.done.set_result([self.outs[i] for i in self.ids])


ADAPTERS_LANE = "adapters"
"""The lane of every adapter request: each names its adapter's version, which vLLM applies per
request, over the one base an adapter service holds (its base is frozen)."""


NEWEST_LANE = "newest"
"""With in-flight updates: the lane of every request for the newest weights of the base. They
share the engine across versions: a weight load runs beside them, and they go on with it."""


NEWEST_ADAPTERS_LANE = "newest adapters"
"""With in-flight updates: the lane of every request for an adapter's newest version. They run
on each adapter's newest slot (``adapter_slots.py``): an adapter's sync runs beside them, and
they go on with its new version."""


def _load_span(shipment: Shipment, trace: str | None) -> Any:
    """The span of one weight sync on this engine, a child of the sync's (``trace``)."""
    return spans.span(
        "sync", parent=trace, step=shipment.version, adapter=shipment.adapter,
        bytes=shipment.nbytes, transport=shipment.transport,
    )  # fmt: skip


def _lane(version: Shipment, req: SampleRequest, in_flight: bool) -> str:
    """The requests that may share the engine's batches with this one: those of the same
    version of the base, or (for an adapter's) those of any adapter, or (with in-flight
    updates) every request for the newest weights of the base, or of any adapter. Base and
    adapter requests never share a batch, nor do a pinned step's and the newest's."""
    newest = in_flight and req.step is None
    if version.adapter is not None:
        return NEWEST_ADAPTERS_LANE if newest else ADAPTERS_LANE
    return NEWEST_LANE if newest else version.id


class VllmSampler:
    """The ``SamplerEngine`` the pool drives: ``VllmEngine`` stepped on a thread of its own,
    requests admitted in ``Turns``' order. Owns the engine, its thread, the turns, the requests
    running and the task that steps them."""

    def __init__(self, index: int, spec: SamplerSpec) -> None:
        self.index = index
        spans.install_from_env(f"engine {index}")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"sampler-{index}")
        self._engine = self._thread.submit(VllmEngine, index, spec).result()
        self._turns = Turns(capacity=spec.concurrency)
        self._in_flight = spec.in_flight
        self._running: dict[str, _Running] = {}
        """By request id."""
        self._owner: dict[str, str] = {}
        """The request id of each prompt in the engine, by its vLLM id."""
        self._stepping: asyncio.Task[None] | None = None

    async def _on_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _load(self, fn: Any, *args: Any, beside: str | None = None) -> Any:
        """``fn`` on the engine's thread in a load's turn: its wait for the turn, and (for a
        ``Loaded``) the weights' transfer and their load, as spans."""
        asked = spans.now()
        async with self._turns.load(beside):
            started = spans.now()
            done = await self._on_thread(fn, *args)
        ended = spans.now()
        if isinstance(done, Loaded):
            spans.record("wait", asked, started)
            moved = started + (done.transfer_s or 0.0)
            if done.transfer_s is not None:
                spans.record("transfer", started, moved)
            spans.record("load", moved, ended)
        return done

    async def pid(self) -> int:
        """This engine's process (``info`` shows it; an operator can find it)."""
        return os.getpid()

    async def sample(
        self,
        request_id: str,
        req: SampleRequest,
        version: Shipment,
        queue_timeout_s: float | None = None,
        trace: str | None = None,
    ) -> SampleResult:
        """One span, a child of ``trace``'s: the request's wait for its turn (``queue``), then
        its ``prefill`` (the first engine step after its admission) and its ``decode``."""
        with spans.span(
            "sample", parent=trace, request=request_id, adapter=req.adapter,
            step=version.version, prompts=len(req.prompts),
        ):  # fmt: skip
            return await self._sample(request_id, req, version, queue_timeout_s)

    async def _sample(
        self,
        request_id: str,
        req: SampleRequest,
        version: Shipment,
        queue_timeout_s: float | None,
    ) -> SampleResult:
        arrived = spans.now()
        if self._engine.runs_alone(req):
            async with self._turns.sample(request_id, queue_timeout_s):
                started = spans.now()
                spans.record("queue", arrived, started)
                alone: SampleResult = await self._on_thread(self._engine.sample, req, version)
                spans.record("generate", started, spans.now())
                return alone
        lane = _lane(version, req, self._in_flight)
        async with self._turns.sample(request_id, queue_timeout_s, lane=lane):
            spans.record("queue", arrived, spans.now())
            t0 = time.perf_counter()
            newest = lane in (NEWEST_LANE, NEWEST_ADAPTERS_LANE)
            ids, step = await self._on_thread(self._engine.admit, request_id, req, version, newest)
            run = _Running(ids, asyncio.get_running_loop().create_future(), spans.now())
            self._running[request_id] = run
            self._owner.update(dict.fromkeys(ids, request_id))
            if self._stepping is None or self._stepping.done():
                self._stepping = asyncio.create_task(self._step_while_running())
            try:
                outs = await run.done
            except asyncio.CancelledError:  # nobody waits for it: free the engine of it
                self._thread.submit(self._engine.cancel, ids)
                raise
            finally:
                del self._running[request_id]
                for i in ids:
                    self._owner.pop(i, None)
            seconds = time.perf_counter() - t0
            finished = spans.now()
            first = run.first_step if run.first_step is not None else finished
            spans.record("prefill", run.admitted, first, tokens=sum(len(p) for p in req.prompts))
            spans.record("decode", first, finished)
            return self._engine.result(req, outs, step, seconds, lane == NEWEST_ADAPTERS_LANE)

    async def _step_while_running(self) -> None:
        """Step the engine while a request waits for outputs; hand each finished prompt's
        output to its request. An error inside a step fails every request running."""
        while any(not r.done.done() for r in self._running.values()):
            started = spans.now()
            try:
                outs = await self._on_thread(self._engine.advance)
            except Exception as e:
                for r in self._running.values():
                    if not r.done.done():
                        r.done.set_exception(e)
                continue
            ended = spans.now()
            for r in self._running.values():
                if r.first_step is None and r.admitted <= started:
                    r.first_step = ended
            for out in outs:
                owner = self._owner.get(out.request_id)
                if owner is not None and owner in self._running:
                    self._running[owner].finished(out)

    async def abort(self, request_id: str) -> bool:
        """Drop a request: one still waiting for its turn at once, one running at the next step
        boundary. True if it will not produce a result."""
        if await self._turns.abort(request_id):
            return True
        run = self._running.get(request_id)
        if run is None or run.done.done():
            return False
        await self._on_thread(self._engine.cancel, run.ids)
        if run.done.done():  # it finished in the step before the cancel
            return False
        aborted = RequestAbortedError(f"request {request_id} was aborted while it ran")
        run.done.set_exception(aborted)
        return True

    async def load_weights(
        self,
        shipment: Shipment,
        member: tuple[dict[str, Any], int] | None = None,
        keep: Sequence[str] = (),
        trace: str | None = None,
    ) -> Loaded:
        """``member``: where this engine joins the group a collective shipment is broadcast
        over (``transport.Link.member``); the engine receives while the sender sends, and
        keeps the copies ``keep`` names. ``trace``: the sync's ``traceparent``."""
        beside = NEWEST_LANE if self._in_flight else None  # they go on with these weights
        with _load_span(shipment, trace):
            loaded: Loaded = await self._load(
                self._engine.load_weights, shipment, member, keep, beside=beside
            )
        return loaded

    async def load_adapter(
        self, shipment: Shipment, keep: Sequence[int], trace: str | None = None
    ) -> Loaded:
        """An adapter's newest version (a sync): with in-flight updates, beside the requests
        for the adapters' newest versions, which go on with it."""
        beside = NEWEST_ADAPTERS_LANE if self._in_flight else None
        with _load_span(shipment, trace):
            loaded: Loaded = await self._load(
                self._engine.load_adapter, shipment, keep, True, beside=beside
            )
        return loaded

    async def clock(self) -> float:
        return spans.now()

    async def recent_spans(
        self, since: float, until: float, offset_s: float
    ) -> tuple[list[spans.SpanRecord], int]:
        return spans.recent(since, until, offset_s)

    async def remove_adapter(self, name: str) -> None:
        await self._load(self._engine.remove_adapter, name)
