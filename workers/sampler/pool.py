"""The sampler engines as the controller drives them: spawn, sync, dispatch, recreate.

- **Spawn**: one Ray actor per engine (``SamplerActor``), each serving one call at a time.
- **Sync**: the controller hands over one object-store reference to a step's HF-named
  tensors; every engine loads it (shared memory on a node, Ray's transfer across nodes: no
  file). The reference is kept, so an engine recreated later loads the same step. An
  adapter's sync is the same with its PEFT tensors, kept per adapter.
- **Dispatch**: a sample request goes to the ready engine with the fewest requests in
  flight. Its result carries the step of the engine's weights.
- **Recreate**: an engine that dies fails its in-flight requests with a retryable 503, and is
  rebuilt in the background with the weights of the step the others serve. So is one that
  does not answer a call within ``call_timeout_s`` (a sample, a load: nothing waits on a sick
  engine for good), and one that answers ``EngineBrokenError``. ``info`` (and ``ready``) show
  it ``restarting`` meanwhile.
- **Refuse**: weights an engine refuses (their names, shapes or dtypes are not the ones it
  serves) leave it serving the step it had; if every live engine refused them, the pool keeps
  the previous step's reference, so a recreated engine loads that one too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import ray

from trainctl.api import (
    InternalError,
    NotReadyError,
    SampleRequest,
    SampleResult,
    SamplerInfo,
    SamplersInfo,
    SyncResult,
    TrainctlError,
)
from trainctl.workers.sampler.engine import EngineBrokenError, Loaded, VllmSampler, engine_env
from trainctl.workers.sampler.spec import SAMPLER_NODE_RESOURCE, SamplerSpec

log = logging.getLogger(__name__)

SamplerActor = ray.remote(VllmSampler)


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


@dataclass(frozen=True)
class PoolOptions:
    num_samplers: int
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    threads: int = 1
    sync: Literal["after_step", "manual"] = "after_step"
    """'after_step': every applied optimizer step is synced; 'manual': on POST /v1/weights/sync."""
    call_timeout_s: float = 300.0
    """The longest an engine may take to answer a sample or a load before it is taken for
    stopped and recreated."""
    start_timeout_s: float = 900.0
    """The longest an engine may take to start (and load the current weights)."""


class SamplerPool:
    def __init__(self, spec: SamplerSpec, options: PoolOptions) -> None:
        self.spec, self.options = spec, options
        self.engines = [_Engine(i) for i in range(options.num_samplers)]
        self.weights: tuple[int, Any] | None = None
        """The step the samplers serve and the object-store reference to its tensors."""
        self.adapters: dict[str, tuple[int, Any]] = {}
        """Each adapter served: its step and the reference to its ``PeftAdapter``."""
        self.last_sync: SyncResult | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def _spawn(self, e: _Engine) -> None:
        env = engine_env(self.options.num_gpus > 0, self.options.threads, self.spec.return_routes)
        kept = any(SAMPLER_NODE_RESOURCE in n.get("Resources", {}) for n in ray.nodes())
        e.actor = SamplerActor.options(  # type: ignore[attr-defined]
            num_cpus=self.options.num_cpus,
            num_gpus=self.options.num_gpus,
            # On a cluster with nodes kept for samplers (the chart's sampler group): one there.
            resources={SAMPLER_NODE_RESOURCE: 1} if kept else {},
            max_concurrency=1,
            max_restarts=0,
            runtime_env={"env_vars": env},
        ).remote(e.index, self.spec)
        e.status, e.step, e.pid = "starting", None, None

    async def start(self) -> None:
        """Build every engine (placeholder weights); ``sync`` gives them real ones."""
        t0 = time.perf_counter()
        for e in self.engines:
            self._spawn(e)
        pids = await asyncio.gather(*(e.actor.pid.remote() for e in self.engines))
        for e, pid in zip(self.engines, pids, strict=True):
            e.status, e.pid = "ready", pid
        log.info("%d sampler engine(s) built in %.1fs", len(self.engines), time.perf_counter() - t0)

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

    async def sync(
        self, step: int, weights: Any, nbytes: int, gather_s: float, adapter: str | None = None
    ) -> SyncResult:
        """Every live engine loads ``weights``: an object-store reference to HF-named tensors,
        or with ``adapter`` to that adapter's ``PeftAdapter``. An engine finishes the request
        it is serving first: one call at a time."""
        previous = self.weights if adapter is None else self.adapters.get(adapter)
        if adapter is None:
            self.weights = (step, weights)
        else:
            self.adapters[adapter] = (step, weights)
        for e in self.engines:
            if e.status == "failed":  # its last recreation failed: try again, with this step
                self._lost(e, RuntimeError(e.last_error or "failed"))
        live = [e for e in self.engines if e.status == "ready"]
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(self._load(e, step, weights, adapter) for e in live), return_exceptions=True
        )
        loaded = [g for g in got if isinstance(g, Loaded)]
        refused = [
            g for g in got if isinstance(g, InternalError) and not isinstance(g, EngineBrokenError)
        ]
        if live and not loaded and len(refused) == len(live) and previous is not None:
            # Every engine refused them and serves the previous step still: so will a
            # recreated one.
            if adapter is None:
                self.weights = previous
            else:
                self.adapters[adapter] = previous
        self.last_sync = SyncResult(
            step=step,
            adapter=adapter,
            samplers=len(loaded),
            bytes=nbytes,
            gather_s=gather_s,
            load_s=time.perf_counter() - t0,
            failures=[str(g) for g in got if isinstance(g, BaseException)],
        )
        return self.last_sync

    async def _call(self, e: _Engine, ref: Any, what: str) -> Any:
        """``e``'s answer to the call ``ref``, within ``call_timeout_s``. An engine that died,
        stopped answering or reports itself broken is recreated (``_lost``), and the call fails
        with a retryable 503; the engine's own refusals (``TrainctlError``) pass through."""
        timeout = self.options.call_timeout_s
        try:
            return await asyncio.wait_for(ref, timeout)
        except TimeoutError:
            cause = f"sampler {e.index} did not answer {what} within {timeout:g} s"
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

    async def _load(self, e: _Engine, step: int, weights: Any, adapter: str | None) -> Loaded:
        ref = (
            e.actor.load_weights.remote(step, weights)
            if adapter is None
            else e.actor.load_adapter.remote(adapter, step, weights)
        )
        loaded: Loaded = await self._call(e, ref, f"the load of step {step}")
        if adapter is None:
            e.step = loaded.step
        return loaded

    async def remove_adapter(self, name: str) -> None:
        """Every engine forgets ``name`` (a deleted adapter is never sampled again)."""
        self.adapters.pop(name, None)
        live = [e for e in self.engines if e.status == "ready"]
        await asyncio.gather(
            *(self._call(e, e.actor.remove_adapter.remote(name), "an adapter's removal")
              for e in live),
            return_exceptions=True,
        )  # fmt: skip

    # -- sampling ----------------------------------------------------------------------------

    def _pick(self) -> _Engine:
        ready = [e for e in self.engines if e.status == "ready" and e.step is not None]
        if not ready:
            if self.weights is None:
                raise NotReadyError(
                    "the samplers have no weights yet: POST /v1/weights/sync (or take a step "
                    "with sync after_step)"
                )
            raise NotReadyError("every sampler engine is being recreated; retry shortly")
        return min(ready, key=lambda e: (e.in_flight, e.index))

    async def sample(self, req: SampleRequest) -> SampleResult:
        e = self._pick()
        e.in_flight += 1
        try:
            result: SampleResult = await self._call(e, e.actor.sample.remote(req), "a sample")
            return result
        finally:
            e.in_flight -= 1

    # -- failures ----------------------------------------------------------------------------

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
                if self.weights is not None:
                    step, weights = self.weights
                    loaded: Loaded = await e.actor.load_weights.remote(step, weights)
                    e.step = loaded.step
                for name, (step, ref) in list(self.adapters.items()):
                    await e.actor.load_adapter.remote(name, step, ref)
            e.restarts += 1
            e.status = "ready"
            log.info("sampler %d recreated (step %s)", e.index, e.step)
        except Exception as err:  # reported in info; the next sync or death tries again
            e.status = "failed"
            e.last_error = f"recreating failed: {err}"[:300]
            log.exception("could not recreate sampler %d", e.index)

    def statuses(self) -> dict[str, int]:
        """The engines counted by status."""
        out: dict[str, int] = {}
        for e in self.engines:
            out[e.status] = out.get(e.status, 0) + 1
        return out

    def info(self) -> SamplersInfo:
        return SamplersInfo(
            sync=self.options.sync,
            step=None if self.weights is None else self.weights[0],
            adapters={name: step for name, (step, _) in self.adapters.items()},
            engines=[
                SamplerInfo(
                    index=e.index,
                    status=e.status,  # type: ignore[arg-type]
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
