"""The sampler engines as the controller drives them: spawn, sync, dispatch, recreate.

- **Spawn**: one Ray actor per engine, of the backend's engine class (``backend.py``: the
  ``SamplerEngine`` protocol; ``--sampler-backend`` picks the backend), an asynchronous
  actor that orders its own calls.
- **Sync**: the controller hands over a ``Shipment`` of a step's HF-named tensors
  (``transport.py``); every engine loads it (or, for a broadcast, every member of the
  transport's ``Link`` receives it). It is published in the window of versions
  (``window.py``: the newest ``--sampler-versions`` of the base and of each adapter), so a
  client pinned to a step keeps sampling it, and an engine recreated later loads the newest.
  An adapter's sync is the same with its PEFT tensors; each version of an adapter is its own
  adapter in the engines.
- **Dispatch**: a sample request names a version (the newest, or its ``step``; past the
  window a 410), which travels with it: an engine that holds another version of the base
  loads it in the request's turn (a swap), so a result is always the version asked for. It
  goes to the ready engine with the fewest requests in flight, one holding that version
  counting one request fewer, under a request id. A caller that gives up (its call
  cancelled) aborts its request on the engine; a sample that waits for the engine's turn
  past its queue timeout leaves unrun with a retryable 503.
- **Recreate**: an engine that dies fails its in-flight requests with a retryable 503, and is
  rebuilt in the background with the weights of the step the others serve (over the
  collective: with none, until the next sync reaches it). So is one that
  answers neither a call within ``call_timeout_s`` nor a ping then (a sample, a load: nothing
  waits on a sick engine for good), and one that answers ``EngineBrokenError``. A busy engine
  answers the ping: a sample waiting its turn is bounded by its queue timeout instead
  (``turns.py``). ``info`` (and ``ready``) show it ``restarting`` meanwhile.
- **Refuse**: weights an engine refuses (their names, shapes or dtypes are not the ones it
  serves) leave it serving the step it had; if every live engine refused them, the pool keeps
  the previous step's reference, so a recreated engine loads that one too.

One concern, at its length: the engines as one pool. Spawn, sync, dispatch and recreate
read and write the same table of engines and the versions each holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from trainctl.api import (
    ConflictError,
    InternalError,
    NotReadyError,
    RateLimitedError,
    SampleRequest,
    SampleResult,
    SamplerInfo,
    SamplersInfo,
    SyncResult,
    TrainctlError,
)
from trainctl.api.errors import GoneError, field_error
from trainctl.api.sampling import SyncMode
from trainctl.workers import spans
from trainctl.workers.sampler import backend
from trainctl.workers.sampler.backend import EngineBrokenError, Loaded
from trainctl.workers.sampler.spec import SAMPLER_NODE_RESOURCE, SamplerSpec
from trainctl.workers.sampler.transport import Link, Shipment
from trainctl.workers.sampler.window import VersionWindow

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 1000
"""Calls an engine actor takes at once: its event loop interleaves them, and the engine
orders its own work (``sample`` waits its turn, ``abort`` and ``pause`` never wait)."""


PING_TIMEOUT_S = 5.0
"""How long a busy engine's event loop may take to answer a ping."""

SWAP_COST = 1
"""What an engine that must load another version of the base for a request counts as, in
requests in flight, when the pool picks one."""


async def _awaited(ref: Any) -> Any:
    return await ref


@dataclass
class _Engine:
    index: int
    actor: Any = None
    status: str = "starting"
    step: int | None = None
    restarts: int = 0
    in_flight: int = 0
    last_error: str | None = None
    pid: int | None = None
    kept: list[str] = field(default_factory=list)
    """The ids of the collective shipments of the base this engine keeps in host memory,
    oldest first (those of the window it received): a broadcast cannot be replayed, so only
    these engines can serve a pinned request for one."""


@dataclass(frozen=True)
class PoolOptions:
    num_samplers: int
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    threads: int = 1
    sync: SyncMode = "after_step"
    """'after_step': every applied optimizer step is synced; 'in_flight': the same, and the
    generations running go on with the new weights; 'manual': on POST /v1/weights/sync."""
    versions: int = 2
    """Versions kept servable of the base and of each adapter (``--sampler-versions``): the
    newest that many syncs, so that one step off-policy works with the default."""
    call_timeout_s: float = 300.0
    """The longest one call may run on an engine (a sample once its turn came, a load) before
    the engine is taken for stopped and recreated."""
    queue_timeout_s: float = 60.0
    """The longest a sample waits for its engine's turn: past it, a retryable 503 and the
    request never runs. A load waits for no sample but the one running."""
    start_timeout_s: float = 900.0
    """The longest an engine may take to start (and load the current weights)."""

    def wait_s(self, asked: float | None) -> float:
        """How long a sample may wait (for its engine's turn, or for fresh enough weights): a
        request's own ``queue_timeout_s`` may shorten the service's, never lengthen it."""
        return self.queue_timeout_s if asked is None else min(self.queue_timeout_s, asked)

    max_queued: int = 256
    """Sample requests the pool holds at once, waiting or running; past it a sample answers
    429 (``RateLimitedError``) instead of waiting behind the others."""
    max_queued_tokens: int = 1 << 24
    """Tokens those requests ask the engines to process at once: for each request, ``n`` times
    every prompt's length plus ``max_tokens``. Past it, 429; one request above it alone, 422."""
    cache_dir: str | None = None
    """The engines' ``XDG_CACHE_HOME`` (the service's data directory), so that what an engine
    caches (vLLM's model inspection, compiled kernels) never lands in the home directory."""


class SamplerPool:
    """The sampler engines. Owns their actors, the window of versions shipped to them (to serve
    a pinned step, and to recreate an engine), the last sync's report and the restart count."""

    def __init__(self, spec: SamplerSpec, options: PoolOptions) -> None:
        self.spec, self.options = spec, options
        self.backend = backend.load(spec.backend)
        self._actor_class: Any = None
        self.engines = [_Engine(i) for i in range(options.num_samplers)]
        self.window = VersionWindow(options.versions)
        self.last_sync: SyncResult | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self.queued_tokens = 0
        """The tokens of the requests admitted and not yet answered (``max_queued_tokens``)."""
        self._delivering: dict[str, asyncio.Event] = {}
        """The collective shipments being received now, by id: a sample for one waits until
        the engines have it (no engine can load it later: a broadcast is not replayed)."""

    @property
    def weights(self) -> Shipment | None:
        """The base's newest version (its step: ``weights.version``)."""
        return self.window.newest(None)

    @property
    def adapters(self) -> dict[str, Shipment]:
        """Each adapter served, by name: its newest version."""
        return {k: s for k in self.window.versions if k is not None if (s := self.window.newest(k))}

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, e: _Engine) -> None:
        o = self.options
        env = self.backend.env(o.num_gpus > 0, o.threads, self.spec.return_routes)
        if o.cache_dir is not None:
            env = {**env, "XDG_CACHE_HOME": o.cache_dir}
        env = {**env, **spans.env()}  # the engine's spans, as the controller keeps its own
        kept = any(SAMPLER_NODE_RESOURCE in n.get("Resources", {}) for n in ray.nodes())
        if self._actor_class is None:
            self._actor_class = ray.remote(self.backend.engine_class())
        e.actor = self._actor_class.options(
            num_cpus=o.num_cpus,
            num_gpus=o.num_gpus,
            # On a cluster with nodes kept for samplers (the chart's sampler group): one there.
            resources={SAMPLER_NODE_RESOURCE: 1} if kept else {},
            max_concurrency=ACTOR_CONCURRENCY,
            max_restarts=0,
            runtime_env={"env_vars": env},
        ).remote(e.index, self.spec)
        e.status, e.step, e.pid, e.kept = "starting", None, None, []

    async def start(self) -> None:
        """Build every engine (placeholder weights); ``sync`` gives them real ones."""
        t0 = time.perf_counter()
        for e in self.engines:
            self._spawn(e)
        pids = await asyncio.gather(*(e.actor.pid.remote() for e in self.engines))
        for e, pid in zip(self.engines, pids, strict=True):
            e.status, e.pid = "ready", pid
        log.info("%d sampler engine(s) built in %.1fs", len(self.engines), time.perf_counter() - t0)

    @staticmethod
    def object_store_bytes() -> float:
        """The Ray cluster's object store, where the window keeps its versions (0: unknown)."""
        return float(ray.cluster_resources().get("object_store_memory", 0.0))

    def kill(self) -> None:
        for t in self._restarts:
            t.cancel()
        for e in self.engines:
            if e.actor is not None:
                ray.kill(e.actor, no_restart=True)
                e.actor = None
            e.status = "failed"

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Wait (at most ``timeout_s``) for the sample requests in flight to finish."""
        deadline = time.monotonic() + timeout_s
        while any(e.in_flight for e in self.engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # -- sync --------------------------------------------------------------------------------

    async def members(self) -> list[tuple[int, int | None]]:
        """The engines a collective sync can reach now: ``(index, pid)`` of each ready one
        that answers a ping (a broadcast waits for every member: one that died must not be
        asked to join). A recreated engine has another pid, so a new group forms."""
        self._retry_failed()
        ready = [e for e in self.engines if e.status == "ready"]
        answers = await asyncio.gather(*(self._answers_ping(e) for e in ready))
        for e, answered in zip(ready, answers, strict=True):
            if not answered:
                self._lost(e, TimeoutError(f"sampler {e.index} did not answer a ping"))
        return [(e.index, e.pid) for e in self.engines if e.status == "ready"]

    async def sync(
        self,
        shipment: Shipment,
        gather_s: float,
        new_line: bool = False,
        link: Link | None = None,
    ) -> SyncResult:
        """Publish ``shipment`` (the base's weights, or an adapter's) as its newest version,
        and have every live engine load it. An engine finishes the requests it is running
        first (never those waiting). ``new_line``: after a checkpoint load or a recovery, whose
        steps name other weights than the window's (it is emptied first). ``link``: the group a
        shipment arrives by (``CollectiveTransport``); only its member engines receive it."""
        adapter = shipment.adapter
        previous = self.window.newest(adapter)
        self.window.publish(shipment, new_line)
        self._retry_failed()  # with this step
        live = [e for e in self.engines if e.status == "ready"]
        if link is not None:
            live = [e for e in live if e.index in link.ranks]
        t0 = time.perf_counter()
        delivered = asyncio.Event()
        if shipment.transport == "collective":  # no engine can load it later: samples wait
            self._delivering[shipment.id] = delivered
        try:
            got = await asyncio.gather(
                *(self._load(e, shipment, link) for e in live), return_exceptions=True
            )
            loaded = [g for g in got if isinstance(g, Loaded)]
            refused = [
                g
                for g in got
                if isinstance(g, InternalError) and not isinstance(g, EngineBrokenError)
            ]
            every_refused = bool(live) and len(refused) == len(live)
            if not loaded and (every_refused or shipment.transport == "collective"):
                # Every engine refused them and serves the previous step still: so will a
                # recreated one. A broadcast that reached no engine is withdrawn too: it
                # cannot be replayed, so nothing could ever serve it.
                self.window.withdraw(shipment, previous)
        finally:  # the samples waiting for it go on: to the engines that keep it, or not
            self._delivering.pop(shipment.id, None)
            delivered.set()
        self.last_sync = SyncResult(
            step=shipment.version,
            adapter=adapter,
            samplers=len(loaded),
            bytes=shipment.nbytes,
            gather_s=gather_s,
            load_s=time.perf_counter() - t0,
            failures=[str(g) for g in got if isinstance(g, BaseException)],
        )
        return self.last_sync

    async def _call(self, e: _Engine, ref: Any, what: str, wait_s: float | None) -> Any:
        """``e``'s answer to the call ``ref``, within ``wait_s`` (what the call may wait for its
        turn; None: as long as it takes) plus ``call_timeout_s``. Every ``call_timeout_s`` of
        waiting the engine is pinged: one that answers is busy, one that does not has stopped.
        An engine that died, stopped answering or reports itself broken is recreated
        (``_lost``), and the call fails with a retryable 503; the engine's own refusals
        (``TrainctlError``) pass through."""
        try:
            return await self._answer(e, ref, wait_s)
        except TimeoutError as err:
            cause = f"sampler {e.index} did not answer {what}: {err}"
            self._lost(e, TimeoutError(cause))
        except ray.exceptions.RayActorError as err:
            self._lost(e, err)
            cause = f"sampler {e.index} died while serving {what}"
        except ray.exceptions.RayTaskError as err:
            error = getattr(err, "cause", None)
            if not isinstance(error, TrainctlError):
                raise
            if not isinstance(error, EngineBrokenError):
                raise error from None  # the engine's own refusal (409, 422, 503, 500)
            self._lost(e, error)
            cause = error.message
        raise NotReadyError(f"{cause}; it is being recreated with the current weights: retry")

    async def _answer(self, e: _Engine, ref: Any, wait_s: float | None) -> Any:
        every = self.options.call_timeout_s
        deadline = None if wait_s is None else time.monotonic() + wait_s + every
        answer = asyncio.ensure_future(_awaited(ref))
        try:
            while True:
                left = every if deadline is None else min(every, deadline - time.monotonic())
                done, _ = await asyncio.wait({answer}, timeout=max(left, 0.0))
                if done:
                    return answer.result()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer within {wait_s:g} + {every:g} s")
                if not await self._answers_ping(e):
                    raise TimeoutError(f"no answer within {every:g} s, nor to a ping")
        finally:
            answer.cancel()

    async def _answers_ping(self, e: _Engine) -> bool:
        """Whether ``e``'s event loop answers (a busy engine does; a hung process does not)."""
        try:
            await asyncio.wait_for(e.actor.pid.remote(), PING_TIMEOUT_S)
            return True
        except (TimeoutError, ray.exceptions.RayActorError):
            return False

    async def _load(
        self,
        e: _Engine,
        shipment: Shipment,
        link: Link | None = None,
    ) -> Loaded:
        if shipment.adapter is None:
            window = [s.id for s in self.window.versions.get(None, {}).values()]
            member = None if link is None else link.member(e.index)
            ref = e.actor.load_weights.remote(shipment, member, window, spans.traceparent())
        else:
            steps = self.window.steps(shipment.adapter)
            ref = e.actor.load_adapter.remote(shipment, steps, spans.traceparent())
        loaded: Loaded = await self._call(
            e, ref, f"the load of step {shipment.version}", wait_s=self.options.call_timeout_s
        )  # a load waits for the sample running, at most
        if shipment.adapter is None:
            e.step = loaded.step
            if shipment.transport == "collective":  # the engine kept those of the window
                e.kept = [i for i in [*e.kept, shipment.id] if i in window]
        return loaded

    async def remove_adapter(self, name: str) -> None:
        """Every engine forgets ``name`` (a deleted adapter is never sampled again)."""
        self.window.restart(name)
        live = [e for e in self.engines if e.status == "ready"]
        await asyncio.gather(
            *(self._call(e, e.actor.remove_adapter.remote(name), "an adapter's removal",
                         wait_s=self.options.call_timeout_s)
              for e in live),
            return_exceptions=True,
        )  # fmt: skip

    # -- sampling ----------------------------------------------------------------------------

    def _pick(self, version: Shipment) -> _Engine:
        """The engine for a request of ``version``: the fewest in flight, counting
        ``SWAP_COST`` more for one that holds another step of the base. A version that came
        by broadcast goes to an engine that keeps it (a 410 if none does any more)."""
        ready = [e for e in self.engines if e.status == "ready" and e.step is not None]
        if not ready:
            raise NotReadyError("every sampler engine is being recreated; retry shortly")
        base = version.version if version.adapter is None else None
        if version.transport == "collective":
            ready = [e for e in ready if version.id in e.kept]
            if not ready:
                raise GoneError(
                    f"step: no sampler engine keeps the weights of step {version.version} any "
                    "more (they came by broadcast, which cannot be replayed, and the engines "
                    "that kept them were recreated since); sample a newer step",
                    details={"field": "step", "step": version.version},
                )

        def load(e: _Engine) -> tuple[int, int]:
            swap = SWAP_COST if base is not None and e.step != base else 0
            return (e.in_flight + swap, e.index)

        return min(ready, key=load)

    def version_of(self, req: SampleRequest) -> Shipment:
        """The version ``req`` samples: the newest of its adapter (or the base), or its
        ``step`` (410 past the window); 409 if ``expected_step`` names another."""
        shipment = self.window.get(req.adapter, req.step)
        if req.expected_step is not None and req.expected_step != shipment.version:
            whose = "" if req.adapter is None else f" of adapter {req.adapter!r}"
            raise ConflictError(
                f"expected_step: the samplers serve the weights{whose} of step "
                f"{shipment.version}, not {req.expected_step}",
                details={"field": "expected_step", "step": shipment.version},
            )
        return shipment

    def admit(self, req: SampleRequest) -> int:
        """The tokens ``req`` asks for, if the pool takes it now; otherwise a 429 (or a 422
        for a request that alone asks for more than the pool ever holds)."""
        o = self.options
        tokens = req.n * (sum(len(p) for p in req.prompts) + req.max_tokens * len(req.prompts))
        if tokens > o.max_queued_tokens:
            raise field_error(
                "prompts",
                f"{len(req.prompts)} prompts x n {req.n} with max_tokens {req.max_tokens} ask "
                f"for {tokens} tokens, more than the samplers hold at once "
                f"(--sampler-max-queued-tokens {o.max_queued_tokens}): split the request",
            )
        queued = sum(e.in_flight for e in self.engines)
        if queued >= o.max_queued or self.queued_tokens + tokens > o.max_queued_tokens:
            raise RateLimitedError(
                f"the samplers hold {queued} requests ({self.queued_tokens} tokens); the "
                f"bound is {o.max_queued} requests and {o.max_queued_tokens} tokens: retry "
                "after the Retry-After seconds",
                details={"queued": queued, "queued_tokens": self.queued_tokens},
                retry_after_s=1.0,
            )
        return tokens

    async def sample(self, req: SampleRequest, *, queue: bool = False) -> SampleResult:
        """``req`` on the least busy engine. Past the admission bound it is a 429 at once, and
        past ``queue_timeout_s`` waiting for the engine's turn a 503; with ``queue`` (a caller
        that already answered its client, as Tinker's ``asample`` does with a future) it waits
        for room and for its turn."""
        version = self.version_of(req)  # a 410, 409 or 404 before waiting for anything
        if (delivery := self._delivering.get(version.id)) is not None:
            await delivery.wait()  # as the engines' requests wait while they receive
            version = self.version_of(req)  # the newest may be the one before, if it failed
        while True:
            try:
                tokens = self.admit(req)
                break
            except RateLimitedError:
                if not queue:
                    raise
                await asyncio.sleep(0.05)
        e = self._pick(version)
        request_id = uuid.uuid4().hex
        e.in_flight += 1
        self.queued_tokens += tokens
        try:
            # A queued caller (Tinker's asample) holds a future already: it waits its turn. A
            # request's own queue_timeout_s may shorten the service's, never lengthen it.
            queue_timeout = None if queue else self.options.wait_s(req.queue_timeout_s)
            trace = spans.traceparent()  # the engine's spans join the caller's trace
            ref = e.actor.sample.remote(request_id, req, version, queue_timeout, trace)
            result: SampleResult = await self._call(e, ref, "a sample", queue_timeout)
            if version.adapter is None:
                e.step = result.step  # the engine holds this version now
            return result
        except asyncio.CancelledError:  # its caller gave up: nothing waits for the result
            if e.actor is not None and e.status == "ready":
                e.actor.abort.remote(request_id)
            raise
        finally:
            e.in_flight -= 1
            self.queued_tokens -= tokens

    # -- failures ----------------------------------------------------------------------------

    def _retry_failed(self) -> None:
        """Recreate again each engine whose last recreation failed."""
        for e in self.engines:
            if e.status == "failed":
                self._lost(e, RuntimeError(e.last_error or "failed"))

    def _lost(self, e: _Engine, err: BaseException) -> None:
        if e.status == "restarting":
            return
        log.warning("sampler %d died: %s; recreating it", e.index, str(err).splitlines()[0])
        e.status, e.step = "restarting", None
        e.last_error = str(err).splitlines()[0][:300]
        task = asyncio.get_running_loop().create_task(self._recreate(e))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _recreate(self, e: _Engine) -> None:
        try:
            if e.actor is not None:
                ray.kill(e.actor, no_restart=True)
            self._spawn(e)
            e.status = "restarting"
            async with asyncio.timeout(self.options.start_timeout_s):
                e.pid = await e.actor.pid.remote()
                weights = self.weights
                # A broadcast cannot be replayed: a recreated engine gets the base's weights
                # from the next collective sync (a new group, with it), and serves none before.
                if weights is not None and weights.transport != "collective":
                    loaded: Loaded = await e.actor.load_weights.remote(weights)
                    e.step = loaded.step
                for name, shipment in self.adapters.items():  # older versions: on demand
                    await e.actor.load_adapter.remote(shipment, self.window.steps(name))
            e.restarts += 1
            e.status = "ready"
            log.info("sampler %d recreated (step %s)", e.index, e.step)
        except Exception as err:  # reported in info; the next sync or death tries again
            e.status = "failed"
            e.last_error = f"recreating failed: {err}"[:300]
            log.exception("could not recreate sampler %d", e.index)

    async def recent_spans(self, since: float, until: float) -> spans.Found:
        """The ready engines' spans overlapping ``[since, until]`` of this process's clock,
        on it (each engine's offset taken from a round trip now), and the spans their rings
        dropped. An engine that does not answer within ``PING_TIMEOUT_S`` is left out."""
        got = await asyncio.gather(
            *(self._recent(e, since, until) for e in self.engines if e.status == "ready")
        )
        return [s for found, _ in got for s in found], sum(lost for _, lost in got)

    async def _recent(self, e: _Engine, since: float, until: float) -> spans.Found:
        try:
            sent = spans.now()
            now = await asyncio.wait_for(_awaited(e.actor.clock.remote()), PING_TIMEOUT_S)
            offset = spans.clock_offset(now, sent, spans.now())
            read = e.actor.recent_spans.remote(since, until, offset)
            found: spans.Found = await asyncio.wait_for(_awaited(read), PING_TIMEOUT_S)
            return found
        except Exception as err:  # a dead or stuck engine: its own path recreates it
            log.info("timeline: sampler engine %d did not answer: %s", e.index, err)
            return [], 0

    def statuses(self) -> dict[str, int]:
        """The engines counted by status."""
        out: dict[str, int] = {}
        for e in self.engines:
            out[e.status] = out.get(e.status, 0) + 1
        return out

    def info(self) -> SamplersInfo:
        adapters = sorted(k for k in self.window.versions if k is not None)
        return SamplersInfo(
            sync=self.options.sync,
            step=None if self.weights is None else self.weights.version,
            adapters={name: s.version for name, s in self.adapters.items()},
            window=self.window.size,
            versions=self.window.steps(None),
            adapter_versions={k: self.window.steps(k) for k in adapters},
            window_bytes=self.window.nbytes(),
            engines=[
                SamplerInfo(
                    index=e.index,
                    status=e.status,
                    step=e.step,
                    restarts=e.restarts,
                    in_flight=e.in_flight,
                    last_error=e.last_error,
                    pid=e.pid,
                )
                for e in self.engines
            ],
            last_sync=self.last_sync,
        )
