"""The controller's samplers: start them, sync them after a step (or on demand), sample.

A sync is an operation (queued with the training calls, so it reads one step's weights). It
runs through a ``WeightTransport`` (``workers/sampler/transport.py``): ``connect`` to the
engines, ``send`` (every rank names the pieces of the Hugging Face tensors it owns, the plan
puts them in buckets, and each owner converts and puts its own, or stages them for the
collective: no rank gathers the model) and ``deliver`` (the engines' loads, with the owners'
sends for the collective transport). This class is the transports' ``WeightSource``: it asks
the rank group for what each one needs. An adapter's sync is its factors alone, in PEFT's
format (a few MB, merged on rank 0), always through the object store: it is synced
when created, after each of its steps (``after_step``), dropped from the samplers when
deleted, and every adapter is synced again after a checkpoint load or a recovery. ``sample``
is not an operation: it never touches the ranks, and runs beside training.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from trainctl.api import (
    AdapterInfo,
    AdapterList,
    ConflictError,
    ModelLimits,
    SampleRequest,
    SampleResult,
    SyncResult,
    SyncWeightsRequest,
    WorkerError,
)
from trainctl.api.adapters import CreateAdapterRequest, DeleteAdapterRequest
from trainctl.api.errors import field_error
from trainctl.workers import spans
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.op_queue import Handle, Runner
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.sampler_settings import (
    SamplerSettings,
    check_engines,
    check_kept,
    check_window,
)
from trainctl.workers.control.serving import Serving
from trainctl.workers.control.staleness import Staleness
from trainctl.workers.control.steps import ModelState
from trainctl.workers.control.telemetry import SYNC_SPAN, ControllerMetrics
from trainctl.workers.engine.config import ConfigError, EngineConfig
from trainctl.workers.rank.worker import RankWorker
from trainctl.workers.sampler.pool import SamplerPool
from trainctl.workers.sampler.spec import SamplerSpec
from trainctl.workers.sampler.stream import Sent, StreamPlan
from trainctl.workers.sampler.transport import (
    CollectiveTransport,
    ObjectStoreTransport,
    WeightTransport,
)

log = logging.getLogger(__name__)


class Samplers:
    """Owns the service's sampler engines (``pool``: None until started, and on a service
    without samplers): their start, every sync, adapters' arrival and departure on them, and
    ``sample``."""

    def __init__(
        self,
        *,
        cfg: EngineConfig,
        limits: ModelLimits,
        group: RankGroup,
        state: ModelState,
        settings: SamplerSettings,
        metrics: ControllerMetrics,
        adapters: Adapters,
        serving: Serving,
        staleness: Staleness | None = None,
    ) -> None:
        self.cfg, self.limits, self.group, self.state = cfg, limits, group, state
        self.settings, self.metrics, self.adapters, self.serving = (
            settings, metrics, adapters, serving,
        )  # fmt: skip
        self.staleness = staleness or Staleness(None, tracks_samplers=False)
        """Told of every version served; paces samples (``staleness.py``)."""
        self.pool: SamplerPool | None = None
        self.transport: WeightTransport = (
            CollectiveTransport(
                settings.bucket_mb * 2**20, settings.pool.call_timeout_s, settings.wire
            )
            if settings.transport == "collective"
            else ObjectStoreTransport(settings.bucket_mb * 2**20)
        )
        """How the base's weights travel (``--sampler-transport``)."""
        self.adapter_transport: WeightTransport = ObjectStoreTransport()
        """How adapters' travel: a few MB each, always through the object store."""
        self.sent: list[Sent] = []
        """What each owner reported of the last base sync."""

    @property
    def step(self) -> int:
        return self.state.step

    async def start(self) -> None:
        """Build the sampler engines and give them the current weights."""
        s = self.settings
        if not s.pool.num_samplers:
            return
        check_engines(self.cfg, s)
        try:
            hf_config = await self.group.call_one(0, RankWorker.hf_config)
        except WorkerError as e:
            problem = e.message.split(": ", 2)[-1]  # "rank 0 failed in hf_config: <error>"
            raise ConfigError(
                f"samplers: this model has no Hugging Face export: {problem}"
            ) from None
        spec = SamplerSpec(
            hf_config=hf_config,
            backend=s.backend,
            dtype=s.dtype,
            max_model_len=self.cfg.model.max_seq_len,
            kv_cache_gib=s.kv_cache_gib,
            seed=self.cfg.model.seed,
            max_adapters=self.cfg.lora.max_adapters,
            max_lora_rank=self.cfg.lora.max_rank,
            versions=s.pool.versions,
            return_routes=s.routes,
            concurrency=s.concurrency,
            in_flight=s.pool.sync == "in_flight",
            # the controller's limits say whether the model has one (string stops)
            tokenizer=self.cfg.init_hf if self.limits.tokenizer else None,
            weight_transfer=s.wire if s.transport == "collective" else None,
        )
        pool = self.pool = SamplerPool(spec, s.pool)
        self.metrics.watch_samplers(
            lag=lambda: float(self.step - pool.weights.version) if pool.weights else float("nan"),
            restarts=lambda: float(sum(e.restarts for e in pool.engines)),
        )
        await pool.start()
        first = await self.sync()
        if s.transport == "object_store":
            check_window(s.pool.versions, first.bytes, pool.object_store_bytes())
        else:  # the collective's versions live in the engines; now their size is exact
            check_kept(s.pool.versions, first.bytes, s.host_memory_gib)
        for name in self.adapters.entries:  # resumed from a checkpoint that holds adapters
            await self.sync(adapter=name)

    def sync_op(self, req: SyncWeightsRequest) -> Runner:
        if self.pool is None:
            raise ConflictError(_NO_SAMPLERS)
        if req.adapter is not None:
            self.adapters.state(req.adapter)  # 404 now, not once queued
        return lambda h: self.sync(h, req.adapter)

    async def sync(
        self, h: Handle | None = None, adapter: str | None = None, new_line: bool = False
    ) -> SyncResult:
        """Every sampler engine loads the ranks' current weights, or ``adapter``'s, published
        as the newest version (``new_line``: after a load, which empties the window first)."""
        with spans.span(SYNC_SPAN, adapter=adapter):  # the sync share (telemetry.py)
            return await self._sync(h, adapter, new_line)

    async def _sync(self, h: Handle | None, adapter: str | None, new_line: bool) -> SyncResult:
        assert self.pool is not None
        if h is not None:
            h.set_phase("gathering weights")
        t0 = time.perf_counter()
        step = self.step if adapter is None else self.adapters.entries[adapter].state.step
        transport = self.transport if adapter is None else self.adapter_transport
        await transport.connect(self.pool)
        self.sent = []
        shipment = await transport.send(self, step, adapter)
        if h is not None:
            h.set_phase("loading weights into the samplers")
        gather_s = time.perf_counter() - t0
        pool = self.pool
        result = await transport.deliver(
            self, shipment, lambda link: pool.sync(shipment, gather_s, new_line, link)
        )
        if self.sent:  # the owners side by side: the slowest's
            result = result.model_copy(update={
                "convert_s": max(s.convert_s for s in self.sent),
                "transfer_s": max(s.transfer_s for s in self.sent),
                "rank_peak_bytes": _most(s.peak_bytes for s in self.sent),
                "rank_private_peak_bytes": _most(s.private_bytes for s in self.sent),
            })  # fmt: skip
        newest = self.pool.window.newest(adapter)
        if newest is not None and newest.version == result.step:  # published, not withdrawn
            await self.staleness.served(adapter, result.step, new_line)
        self.metrics.sync_seconds.observe(result.gather_s + result.load_s)
        log.info(
            "synced %s step %d to %d sampler(s): gather %.3fs, load %.3fs",
            "the base" if adapter is None else f"adapter {adapter!r}", result.step,
            result.samplers, result.gather_s, result.load_s,
        )  # fmt: skip
        return result

    async def stream_plan(self, bucket_bytes: int) -> StreamPlan:
        """``WeightSource``: every rank says which pieces of the Hugging Face tensors it owns;
        in buckets, checked to tile the model once (``StreamPlan.of``)."""
        pieces = await self.group.call(RankWorker.stream_pieces)
        return StreamPlan.of(dict(enumerate(pieces)), bucket_bytes)

    async def to_object_store(self, plan: StreamPlan) -> list[Any]:
        """``WeightSource``: each owner puts its buckets in the object store, side by side."""
        out = await asyncio.gather(
            *(self.group.call_one(r, RankWorker.stream_to_object_store, plan, spans.traceparent())
              for r in plan.owners)
        )  # fmt: skip
        self.sent = [sent for _, sent in out]
        by_owner = {r: iter(refs) for r, (refs, _) in zip(plan.owners, out, strict=True)}
        return [next(by_owner[b.owner]) for b in plan.buckets]

    async def adapter_to_object_store(self, adapter: str) -> tuple[Any, int]:
        """``WeightSource``: ``adapter``'s factors merged on rank 0 in PEFT's format."""
        g = self.group
        weights, size = g.gather_on_rank0_split(
            "adapter", adapter, RankWorker.peft_weights, adapter
        )
        return weights, await g.fetch(size, "gathering the adapter for the samplers")

    async def open_collective(
        self, plan: StreamPlan, receivers: int, generation: int, timeout_s: float,
        backend: str = "gloo", bucket_bytes: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """``WeightSource``: rank 0 makes the group's rendezvous, every other owner joins
        by it; each stages its buckets."""
        g, (first, *others) = self.group, plan.owners
        if first != 0:
            raise RuntimeError(f"rank 0 owns no weights (the owners are {plan.owners})")
        args = (plan, receivers, generation, timeout_s)
        wire = (backend, bucket_bytes)
        rv: dict[str, Any] = await g.call_one(0, RankWorker.open_collective, *args, None, *wire)
        await asyncio.gather(
            *(g.call_one(r, RankWorker.open_collective, *args, rv, *wire) for r in others)
        )
        return rv

    async def send_collective(self, plan: StreamPlan) -> int:
        """``WeightSource``: every owner of ``plan`` sends its staged buckets; the bytes each
        engine got."""
        out = await asyncio.gather(
            *(self.group.call_one(r, RankWorker.send_collective, spans.traceparent())
              for r in plan.owners)
        )  # fmt: skip
        self.sent = list(out)
        return sum(s.nbytes for s in out)

    async def sync_after_change(
        self, adapter: str | None = None, new_line: bool = False
    ) -> str | None:
        """After an applied step (of the base or of ``adapter``) or an adapter's creation
        (``sync: after_step``): sync it, and report a failure as a warning (the step stands).
        ``new_line``: after a load, whose steps may name other weights than the window's."""
        if self.pool is None:
            return None
        if self.settings.pool.sync == "manual":
            if new_line:  # the window's versions are another line's: none is served now
                self.pool.window.restart(adapter)
                self.staleness.forget(adapter)
            return None
        what = "" if adapter is None else f"adapter {adapter!r}'s "
        try:
            r = await self.sync(adapter=adapter, new_line=new_line)
        except Exception as e:
            log.exception("sync of %sstep failed", what)
            return f"{what}step stands, but the samplers could not load it: {e}"
        if r.samplers < len(self.pool.engines):
            why = "; ".join(r.failures) or (
                "the others are being recreated; they get the next sync"
                if self.settings.transport == "collective"
                else "the others are being recreated with it"
            )
            return (
                f"{what}step {r.step} was loaded by {r.samplers} of "
                f"{len(self.pool.engines)} samplers: {why}"
            )
        return None

    async def sync_after_load(self, adapter: str | None = None) -> str | None:
        """After a checkpoint load or a recovery: the base and every adapter the ranks now
        hold are synced; an adapter they no longer hold leaves the samplers. ``adapter``:
        the load restored that adapter alone, and only it is synced."""
        if self.pool is None:
            return None
        if adapter is not None:
            return await self.sync_after_change(adapter, new_line=True)
        for name in set(self.pool.adapters) - set(self.adapters.entries):
            await self.pool.remove_adapter(name)
            self.staleness.forget(name)
        warnings = [await self.sync_after_change(new_line=True)]
        warnings += [
            await self.sync_after_change(name, new_line=True) for name in self.adapters.entries
        ]
        return "; ".join(w for w in warnings if w) or None

    def create_adapter_op(self, req: CreateAdapterRequest) -> Runner:
        run = self.adapters.create(req)

        async def created(h: Handle) -> AdapterInfo:
            info: AdapterInfo = await run(h)
            warning = await self.sync_after_change(req.name)  # sample it from step 0 on
            if warning:
                log.warning("after creating adapter %r: %s", req.name, warning)
            return info

        return created

    def delete_adapter_op(self, req: DeleteAdapterRequest) -> Runner:
        run = self.adapters.delete(req)

        async def deleted(h: Handle) -> AdapterList:
            out: AdapterList = await run(h)
            if self.pool is not None:
                await self.pool.remove_adapter(req.name)
            self.staleness.forget(req.name)
            return out

        return deleted

    def check_room(self, req: SampleRequest) -> None:
        """A 410 if the version ``req`` names has left the window, and a 429 if the samplers
        hold as much as their admission bound now (nothing is reserved: a caller that then
        queues waits for room as it would)."""
        if self.pool is None:
            raise ConflictError(_NO_SAMPLERS)
        self.pool.version_of(req)
        self.pool.admit(req)

    async def sample(self, req: SampleRequest, queue: bool = False) -> SampleResult:
        """``queue``: wait for room past the samplers' admission bound instead of a 429."""
        self.serving.check()
        if self.pool is None:
            raise ConflictError(_NO_SAMPLERS)
        # The gateway checked these already; an engine must never see a token outside the
        # vocabulary or a prompt past its context, whoever calls.
        req.check_limits(self.limits)
        if req.return_routes and not self.settings.routes:
            raise field_error(
                "return_routes",
                "the samplers capture no routes: start the service with --sampler-routes "
                "(a mixture-of-experts model on GPU sampler engines)",
            )
        t0 = time.perf_counter()
        if req.adapter is not None:
            self.adapters.state(req.adapter)  # a 404 naming it, or the 422 of a base service
        if req.step is None:  # the newest weights: not so old that their data is refused
            wait_s = self.pool.options.wait_s(req.queue_timeout_s)
            await self.staleness.pace(lambda: self._behind(req.adapter), wait_s, req.adapter)
        result = await self.pool.sample(req, queue=queue)
        self.metrics.sample_seconds.observe(time.perf_counter() - t0)
        self.metrics.sampled_tokens.inc(
            sum(len(c.tokens) for s in result.samples for c in s.completions)
        )
        return result

    def _behind(self, adapter: str | None) -> int:
        """Steps the newest weights the samplers serve of ``adapter`` (or the base) are behind
        the trainer's (0 when they serve none: sampling answers that itself)."""
        assert self.pool is not None
        newest = self.pool.window.newest(adapter)
        if newest is None:
            return 0
        entry = None if adapter is None else self.adapters.entries.get(adapter)
        step = self.step if entry is None else entry.state.step
        return step - newest.version


_NO_SAMPLERS = "this service has no samplers: start it with --samplers N"


def _most(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
