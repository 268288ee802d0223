"""The controller's samplers: start them, sync them after a step (or on demand), sample.

A sync is an operation (queued with the training calls, so it reads one step's weights):
every rank sends its canonical shards to rank 0, which merges them into the model under its
Hugging Face names (``export_hf``'s mapping) and puts them in the object store once; every
sampler engine loads that object. ``sample`` is not an operation: it never touches the
ranks, and runs beside training.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import ray

from trainctl.api import (
    ConflictError,
    ModelLimits,
    SampleRequest,
    SampleResult,
    SyncResult,
    SyncWeightsRequest,
    WorkerError,
)
from trainctl.workers.control.op_queue import Handle, Runner
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.telemetry import ControllerMetrics
from trainctl.workers.engine.config import ConfigError
from trainctl.workers.sampler.pool import PoolOptions, SamplerPool
from trainctl.workers.sampler.spec import SamplerSpec

if TYPE_CHECKING:
    from trainctl.workers.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSettings:
    """``trainctl serve``'s sampler settings, as the controller takes them: the pool's as
    they are, and what the engines' ``SamplerSpec`` takes besides the model's config (which
    only the ranks know)."""

    pool: PoolOptions = field(default_factory=lambda: PoolOptions(num_samplers=0))
    dtype: Literal["float32", "bfloat16"] = "float32"
    kv_cache_gib: int = 1


class SamplingPart:
    """Mixed into ``Controller``: what it needs of the controller is declared here."""

    cfg: EngineConfig
    limits: ModelLimits
    group: RankGroup
    sampler_settings: SamplerSettings
    samplers: SamplerPool | None
    metrics: ControllerMetrics

    if TYPE_CHECKING:

        @property
        def step(self) -> int: ...

        def _check_serving(self) -> None: ...

    async def _start_samplers(self) -> None:
        """Build the sampler engines and give them the current weights."""
        s = self.sampler_settings
        if not s.pool.num_samplers:
            return
        try:
            hf_config = await self.group.ranks[0].hf_config.remote()
        except ray.exceptions.RayTaskError as e:
            raise ConfigError(
                f"samplers: this model has no Hugging Face export: {e.cause}"
            ) from None
        spec = SamplerSpec(
            hf_config=hf_config,
            dtype=s.dtype,
            max_model_len=self.cfg.model.max_seq_len,
            kv_cache_gib=s.kv_cache_gib,
            seed=self.cfg.model.seed,
        )
        pool = self.samplers = SamplerPool(spec, s.pool)
        self.metrics.watch_samplers(
            lag=lambda: float(self.step - pool.weights[0]) if pool.weights else float("nan"),
            restarts=lambda: float(sum(e.restarts for e in pool.engines)),
        )
        await pool.start()
        await self._sync()

    def _sync_op(self, req: SyncWeightsRequest) -> Runner:
        if self.samplers is None:
            raise ConflictError(_NO_SAMPLERS)
        return lambda h: self._sync(h)

    async def _sync(self, h: Handle | None = None) -> SyncResult:
        """Every sampler engine loads the ranks' current weights."""
        assert self.samplers is not None
        if h is not None:
            h.set_phase("gathering weights")
        t0 = time.perf_counter()
        parts = [r.canonical_shards.remote() for r in self.group.ranks]
        weights, size = self.group.ranks[0].hf_weights.options(num_returns=2).remote(parts)
        try:
            nbytes = int(await size)
        except ray.exceptions.RayError as e:
            raise WorkerError(f"gathering the weights for the samplers failed: {e}") from None
        if h is not None:
            h.set_phase("loading weights into the samplers")
        result = await self.samplers.sync(self.step, weights, nbytes, time.perf_counter() - t0)
        self.metrics.sync_seconds.observe(result.gather_s + result.load_s)
        log.info(
            "synced step %d to %d sampler(s): gather %.3fs, load %.3fs",
            result.step, result.samplers, result.gather_s, result.load_s,
        )  # fmt: skip
        return result

    async def _sync_after_change(self) -> str | None:
        """After an applied step, a load or a recovery (``sync: after_step``): sync, and
        report a failure as a warning (the step stands)."""
        if self.samplers is None or self.sampler_settings.pool.sync != "after_step":
            return None
        try:
            r = await self._sync()
        except Exception as e:
            log.exception("sync of step %d failed", self.step)
            return f"step {self.step} stands, but the samplers could not load it: {e}"
        if r.samplers < len(self.samplers.engines):
            return (
                f"step {self.step} was loaded by {r.samplers} of {len(self.samplers.engines)} "
                "samplers; the others are being recreated with it"
            )
        return None

    async def sample(self, req: SampleRequest) -> SampleResult:
        self._check_serving()
        if self.samplers is None:
            raise ConflictError(_NO_SAMPLERS)
        # The gateway checked these already; an engine must never see a token outside the
        # vocabulary or a prompt past its context, whoever calls.
        req.check_limits(self.limits)
        t0 = time.perf_counter()
        result = await self.samplers.sample(req)
        self.metrics.sample_seconds.observe(time.perf_counter() - t0)
        self.metrics.sampled_tokens.inc(
            sum(len(c.tokens) for s in result.samples for c in s.completions)
        )
        return result


_NO_SAMPLERS = "this service has no samplers: start it with --samplers N"
