"""The controller: one named Ray actor per served model.

It owns the rank actors (one per global rank, in a placement group), plans each step on the
host (``workers/plan.py``), puts the plan in the object store once, fans it out to every rank
and merges the ranks' reports into one result. Mutating operations are serialised: one model,
one writer. It imports no torch: the engine lives in the rank actors.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainctl.api import (
    EvalBatchRequest,
    Info,
    InvalidRequestError,
    MemoryProfileResult,
    MemoryProfileStarted,
    ModelLimits,
    NotReadyError,
    ProfileFile,
    RankInfo,
    StepResult,
    TrainBatchRequest,
    WorkerError,
)
from trainctl.api import Sequence as ApiSequence
from trainctl.api.errors import ConflictError, TrainctlError
from trainctl.api.models import LossConfig
from trainctl.workers.batch import HostSequence, LossSpec, StepPlan
from trainctl.workers.config import ConfigError, EngineConfig
from trainctl.workers.plan import plan_step
from trainctl.workers.rank import RankWorker

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
CONTROLLER_NAME = "trainctl-controller"
NAMESPACE = "trainctl"


def to_host_sequences(seqs: Sequence[ApiSequence]) -> list[HostSequence]:
    def floats(x: list[float] | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x, np.float32)

    out = []
    for s in seqs:
        mask = np.ones(len(s.tokens), np.float32)
        if s.loss_mask is not None:
            mask = np.asarray(s.loss_mask, np.float32)
        out.append(
            HostSequence(
                tokens=np.asarray(s.tokens, np.int64),
                loss_mask=mask,
                weights=floats(s.weights),
                advantages=floats(s.advantages),
                old_logprobs=floats(s.old_logprobs),
                ref_logprobs=floats(s.ref_logprobs),
            )
        )
    return out


def loss_spec(cfg: LossConfig) -> LossSpec:
    return LossSpec(
        kind=cfg.kind, clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trainctl", "megatron-core", "torch", "ray"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


class Controller:
    """Plain class; ``ControllerActor`` below is its Ray actor."""

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        profile_root: str,
        rank_num_cpus: float,
        rank_num_gpus: float = 0.0,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self.cfg = EngineConfig.from_dict(cfg).validate()
        self.profile_root = Path(profile_root)
        self.rank_num_cpus = rank_num_cpus
        self.rank_num_gpus = rank_num_gpus
        self.ranks: list[Any] = []
        self.rank_meta: list[dict[str, Any]] = []
        self.pg: Any = None
        self.step = 0
        self.ready = False
        self.draining = False
        self.lock = asyncio.Lock()
        self.profile_id: str | None = None
        self.limits = ModelLimits(
            vocab_size=self.cfg.model.vocab_size, max_seq_len=self.cfg.model.max_seq_len
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Info:
        """Create the rank actors, form the process group and build every engine shard."""
        world = self.cfg.layout.world_size
        t0 = time.perf_counter()
        log.info("starting %d rank actors (%s)", world, self.cfg.layout.describe())
        need = world * self.rank_num_cpus
        have = ray.cluster_resources().get("CPU", 0.0)
        if need > have:
            raise ConfigError(
                f"{world} ranks x {self.rank_num_cpus} CPU = {need:g} CPUs, but the Ray cluster "
                f"has {have:g}: lower --rank-num-cpus or the parallel sizes, or add nodes"
            )
        bundle = {"CPU": self.rank_num_cpus}
        if self.rank_num_gpus:
            bundle["GPU"] = self.rank_num_gpus  # one rank per GPU on GPU nodes
        self.pg = placement_group([bundle] * world, strategy="PACK")
        try:
            await asyncio.wait_for(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            remove_placement_group(self.pg)
            raise NotReadyError(
                f"the {world} rank actors could not be placed within {PLACEMENT_TIMEOUT_S:.0f}s "
                f"({need:g} CPUs requested; {have:g} in the cluster, some may be in use)"
            ) from None
        actor_cls = ray.remote(RankWorker)
        self.ranks = [
            actor_cls.options(
                num_cpus=self.rank_num_cpus,
                num_gpus=self.rank_num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
                name=f"trainctl-rank-{i}",
            ).remote(i, world)
            for i in range(world)
        ]
        host, port = await self.ranks[0].rendezvous_address.remote()
        await asyncio.gather(
            *[
                r.init_process_group.remote(
                    host, port, self.cfg.backend, self.cfg.collective_timeout_s
                )
                for r in self.ranks
            ]
        )
        log.info("process group formed at %s:%d; building engine shards", host, port)
        self.rank_meta = await asyncio.gather(
            *[r.build.remote(self.cfg.to_dict()) for r in self.ranks]
        )
        self.ready = True
        log.info("%d ranks ready in %.1fs", world, time.perf_counter() - t0)
        return await self.info()

    async def start_once(self) -> None:
        """``start`` unless the ranks are already up (a Serve redeploy reuses the controller)."""
        async with self.lock:
            if not self.ranks:
                await self.start()

    async def drain(self) -> None:
        """Refuse new work and wait for the operation in flight to finish."""
        self.draining = True
        async with self.lock:
            pass

    async def shutdown(self) -> None:
        await self.drain()
        for r in self.ranks:
            ray.kill(r)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.ranks, self.ready = [], False

    # -- helpers -----------------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.draining:
            raise NotReadyError("the service is shutting down")
        if not self.ready:
            raise NotReadyError("the workers are still starting; retry shortly")

    async def _on_all_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank; a failure names the rank and its cause."""
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        results = await asyncio.gather(*refs, return_exceptions=True)
        for rank, res in enumerate(results):
            if isinstance(res, TrainctlError):
                raise res
            if isinstance(res, BaseException):
                cause = getattr(res, "cause", None) or res
                raise WorkerError(
                    f"rank {rank} failed in {method}: {type(cause).__name__}: {cause}",
                    details={"rank": rank, "method": method},
                )
        return list(results)

    def _plan(self, req: TrainBatchRequest | EvalBatchRequest) -> StepPlan:
        req.check_limits(self.limits)
        try:
            return plan_step(
                to_host_sequences(req.sequences),
                self.cfg,
                loss=loss_spec(req.loss),
                normalization=req.loss.normalization,
            )
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e

    def _result(self, plan: StepPlan, reports: list[Any], t_plan: float, t0: float) -> StepResult:
        last = next(r for r in reports if r.is_last_stage)
        metrics = {
            "loss:mean": last.loss,
            "tokens:sum": float(plan.num_tokens),
            "loss_tokens:sum": float(plan.loss_normalizer),
            "sequences:sum": float(plan.num_sequences),
            "padded_tokens:sum": float(plan.padded_tokens),
            "microbatches_per_dp_rank:value": float(plan.num_microbatches),
            "dummy_microbatches:sum": float(plan.num_dummies),
        }
        metrics.update(last.metrics)
        if last.grad_norm is not None:
            metrics["grad_norm:value"] = last.grad_norm
            metrics["lr:value"] = self.cfg.optimizer.lr
        timings = {"plan_s": t_plan, "total_s": time.perf_counter() - t0}
        for key in reports[0].timings:
            timings[f"{key.removesuffix('_s')}_max_s"] = max(r.timings[key] for r in reports)
        return StepResult(loss=last.loss, step=self.step, metrics=metrics, timings=timings)

    # -- the RPC surface ---------------------------------------------------------------------

    async def train_batch(self, req: TrainBatchRequest) -> StepResult:
        self._check_serving()
        t0 = time.perf_counter()
        plan = self._plan(req)  # rejected requests never reach a rank
        t_plan = time.perf_counter() - t0
        async with self.lock:
            ref = ray.put(plan)
            reports = await self._on_all_ranks("train_batch", ref)
            self.step += 1
            return self._result(plan, reports, t_plan, t0)

    async def eval_batch(self, req: EvalBatchRequest) -> StepResult:
        self._check_serving()
        t0 = time.perf_counter()
        plan = self._plan(req)
        t_plan = time.perf_counter() - t0
        async with self.lock:
            reports = await self._on_all_ranks("eval_batch", ray.put(plan))
            return self._result(plan, reports, t_plan, t0)

    async def start_memory_profile(self, max_entries: int) -> MemoryProfileStarted:
        self._check_serving()
        async with self.lock:
            if self.profile_id is not None:
                raise ConflictError(f"memory profile {self.profile_id} is already recording")
            await self._on_all_ranks("start_memory_profile", max_entries)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            self.profile_id = f"{stamp}-step{self.step:06d}"
            return MemoryProfileStarted(profile_id=self.profile_id, ranks=len(self.ranks))

    async def stop_memory_profile(self) -> MemoryProfileResult:
        self._check_serving()
        async with self.lock:
            if self.profile_id is None:
                raise ConflictError("no memory profile is recording; start one first")
            pid, self.profile_id = self.profile_id, None
            directory = self.profile_root / pid
            files = await self._on_all_ranks("stop_memory_profile", str(directory))
            return MemoryProfileResult(profile_id=pid, files=[ProfileFile(**f) for f in files])

    async def info(self) -> Info:
        digests = await self._on_all_ranks("weights_digest") if self.ranks else []
        replica0 = [
            d
            for d, m in zip(digests, self.rank_meta, strict=True)
            if m["coords"]["dp"] == 0 and m["coords"]["cp"] == 0
        ]
        cfg = self.cfg
        return Info(
            model={k: v for k, v in cfg.to_dict()["model"].items()},
            layout={k: v for k, v in cfg.to_dict()["layout"].items()},
            engine={
                "max_tokens_per_microbatch": cfg.max_tokens_per_microbatch,
                "logprob_chunk_size": cfg.logprob_chunk_size,
                "lr": cfg.optimizer.lr,
                "clip_grad": cfg.optimizer.clip_grad,
                "weight_decay": cfg.optimizer.weight_decay,
                "parameters_per_replica": sum(
                    m["parameters"]
                    for m in self.rank_meta
                    if m["coords"]["dp"] == 0 and m["coords"]["cp"] == 0
                ),
            },
            world_size=cfg.layout.world_size,
            step=self.step,
            weights_digest=hashlib.sha256("".join(replica0).encode()).hexdigest(),
            ranks=[
                RankInfo(rank=m["rank"], coords=m["coords"], weights_digest=d)
                for m, d in zip(self.rank_meta, digests, strict=True)
            ],
            versions=_versions(),
            limits=self.limits,
        )

    async def is_ready(self) -> bool:
        return self.ready and not self.draining

    async def model_limits(self) -> ModelLimits:
        return self.limits


ControllerActor = ray.remote(Controller)
