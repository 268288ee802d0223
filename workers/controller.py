"""The controller: one named Ray actor per served model.

It owns the rank actors (one per global rank, in a placement group), plans each step on the
host (``workers/plan.py``), puts the plan in the object store once, fans it out to every rank
and merges the ranks' reports into one result. Every call that touches the ranks is an
operation (``workers/operations.py``): queued, run one at a time in arrival order, idempotent
under a key. It imports no torch: the engine lives in the rank actors.

A train step has two phases so that no rank applies a step another rank failed: every rank
accumulates gradients; only if all succeed does every rank apply the optimizer step. If any
fails, all drop their gradients and the error names the rank and its cause.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainctl.api import (
    EvalBatchRequest,
    Info,
    InvalidRequestError,
    LogProbsRequest,
    LogProbsResult,
    MemoryProfileList,
    MemoryProfileResult,
    MemoryProfileStarted,
    ModelLimits,
    NotReadyError,
    RankInfo,
    StepResult,
    TrainBatchRequest,
    WorkerError,
)
from trainctl.api import Sequence as ApiSequence
from trainctl.api.errors import ConflictError, TrainctlError
from trainctl.api.models import LossConfig
from trainctl.workers import logs
from trainctl.workers.batch import HostSequence, LossSpec, StepPlan
from trainctl.workers.config import ConfigError, EngineConfig
from trainctl.workers.operations import Handle, OperationHost, OperationQueue
from trainctl.workers.plan import plan_step
from trainctl.workers.profile_store import ProfileStore
from trainctl.workers.rank import RankWorker
from trainctl.workers.telemetry import ControllerMetrics

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
CONTROLLER_NAME = "trainctl-controller"
NAMESPACE = "trainctl"


def to_host_sequences(
    seqs: Sequence[ApiSequence], *, all_targets: bool = False
) -> list[HostSequence]:
    """Request sequences as host arrays; ``all_targets`` ignores the masks (log-probs)."""

    def floats(x: list[float] | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x, np.float32)

    out = []
    for s in seqs:
        mask = np.ones(len(s.tokens), np.float32)
        if s.loss_mask is not None and not all_targets:
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


KINDS = ("train_batch", "eval_batch", "logprobs", "memory_profile_start", "memory_profile_stop")
"""Operations the controller runs; the gateway names one per call."""

_FORWARDED_ENV = ("TRAINCTL_LOG_LEVEL", "TRAINCTL_LOG_FORMAT")


class Controller(OperationHost):
    """Plain class; ``ControllerActor`` below is its Ray actor."""

    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        profile_root: str,
        rank_num_cpus: float,
        rank_num_gpus: float = 0.0,
        max_queued_operations: int = 64,
    ) -> None:
        logs.configure()
        self.cfg = EngineConfig.from_dict(cfg).validate()
        self.profiles = ProfileStore(profile_root)
        self.rank_num_cpus = rank_num_cpus
        self.rank_num_gpus = rank_num_gpus
        self.ranks: list[Any] = []
        self.rank_meta: list[dict[str, Any]] = []
        self.pg: Any = None
        self.step = 0
        self.ready = False
        self.draining = False
        self.start_lock = asyncio.Lock()
        self.profile_id: str | None = None
        self.queue = OperationQueue(max_queued=max_queued_operations)
        self.metrics = ControllerMetrics(lambda: self.queue.depth)
        self.queue.listeners.append(self.metrics.observe)
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
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        self.ranks = [
            actor_cls.options(
                num_cpus=self.rank_num_cpus,
                num_gpus=self.rank_num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
                name=f"trainctl-rank-{i}",
                runtime_env={"env_vars": env},
            ).remote(i, world)
            for i in range(world)
        ]
        host, port = await self.ranks[0].rendezvous_address.remote(self.cfg.collective_timeout_s)
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
        async with self.start_lock:
            if not self.ranks:
                await self.start()

    async def drain(self) -> None:
        """Refuse new work, fail what is queued, and let the operation in flight finish."""
        self.draining = True
        n = self.queue.fail_pending(NotReadyError("the service is shutting down"))
        if n:
            log.info("failed %d queued operation(s): shutting down", n)
        await self.queue.idle()

    async def shutdown(self) -> None:
        await self.drain()
        for r in self.ranks:
            ray.kill(r)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.ranks, self.ready = [], False

    # -- operations --------------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.draining:
            raise NotReadyError("the service is shutting down")
        if not self.ready:
            raise NotReadyError("the workers are still starting; retry shortly")

    def _prepare(self, kind: str, req: Any) -> Any:
        """Validate and plan ``req`` now; return the coroutine function that runs it later."""
        batch_kinds = {
            "train_batch": TrainBatchRequest,
            "eval_batch": EvalBatchRequest,
            "logprobs": LogProbsRequest,
        }
        if kind in batch_kinds and isinstance(req, batch_kinds[kind]):
            t0 = time.perf_counter()
            plan = self._plan(req)
            t_plan = time.perf_counter() - t0
            if isinstance(req, TrainBatchRequest):
                return lambda h: self._train(h, req, plan, t_plan)
            if isinstance(req, EvalBatchRequest):
                return lambda h: self._eval(h, plan, t_plan)
            return lambda h: self._logprobs(h, req, plan)
        if kind == "memory_profile_start" and isinstance(req, int):
            return lambda h: self._start_profile(req)
        if kind == "memory_profile_stop":
            return lambda h: self._stop_profile()
        raise InvalidRequestError(f"no operation {kind!r} taking {type(req).__name__}")

    def _plan(self, req: TrainBatchRequest | EvalBatchRequest | LogProbsRequest) -> StepPlan:
        req.check_limits(self.limits)
        logprobs = isinstance(req, LogProbsRequest)
        loss = LossConfig() if logprobs else req.loss  # type: ignore[union-attr]
        try:
            return plan_step(
                to_host_sequences(req.sequences, all_targets=logprobs),
                self.cfg,
                loss=loss_spec(loss),
                normalization=loss.normalization,
            )
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e

    async def _on_all_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank; a failure names each failing rank and its cause."""
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        results = await asyncio.gather(*refs, return_exceptions=True)
        failed = {rank: res for rank, res in enumerate(results) if isinstance(res, BaseException)}
        if not failed:
            return list(results)
        for res in failed.values():
            if isinstance(res, TrainctlError):
                raise res
        dead = [
            rank for rank, res in failed.items() if isinstance(res, ray.exceptions.RayActorError)
        ]
        causes = {
            rank: f"{type(c).__name__}: {c}"
            for rank, res in failed.items()
            for c in [getattr(res, "cause", None) or res]
        }
        if dead:
            self.ready = False
            raise NotReadyError(
                f"rank(s) {dead} died during {method}; the step was not applied",
                details={"ranks": dead, "method": method},
            )
        first = min(causes)
        raise WorkerError(
            f"rank {first} failed in {method}: {causes[first]}"
            + (f" (and {len(causes) - 1} more rank(s))" if len(causes) > 1 else ""),
            details={"method": method, "ranks": {str(r): c for r, c in causes.items()}},
        )

    def _result(self, plan: StepPlan, reports: list[Any], t_plan: float) -> StepResult:
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
        timings = {"plan_s": t_plan}
        for key in reports[0].timings:
            timings[f"{key.removesuffix('_s')}_max_s"] = max(r.timings[key] for r in reports)
        return StepResult(loss=last.loss, step=self.step, metrics=metrics, timings=timings)

    async def _train(
        self, h: Handle, req: TrainBatchRequest, plan: StepPlan, t_plan: float
    ) -> StepResult:
        if req.expected_step is not None and req.expected_step != self.step:
            raise ConflictError(
                f"expected_step is {req.expected_step} but the model is at step {self.step}; "
                "nothing was applied",
                details={"expected_step": req.expected_step, "step": self.step},
            )
        t0 = time.perf_counter()
        ref = ray.put(plan)
        h.set_phase("forward_backward")
        try:
            reports = await self._on_all_ranks("accumulate", ref, h.op.id)
        except TrainctlError:
            await self._discard()
            raise
        h.set_phase("optimizer_step")
        applied = await self._on_all_ranks("apply", h.op.id)
        self.step += 1
        result = self._result(plan, reports, t_plan)
        result.metrics["grad_norm:value"] = applied[0][0]
        result.metrics["lr:value"] = self.cfg.optimizer.lr
        result.timings["optimizer_max_s"] = max(a[1] for a in applied)
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    async def _discard(self) -> None:
        """After a failed phase 1: every surviving rank drops its gradients."""
        refs = [r.discard.remote() for r in self.ranks]
        await asyncio.gather(*refs, return_exceptions=True)
        log.warning("step not applied: gradients dropped on every rank")

    async def _eval(self, h: Handle, plan: StepPlan, t_plan: float) -> StepResult:
        t0 = time.perf_counter()
        h.set_phase("forward")
        reports = await self._on_all_ranks("eval_batch", ray.put(plan), h.op.id)
        result = self._result(plan, reports, t_plan)
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    async def _logprobs(self, h: Handle, req: LogProbsRequest, plan: StepPlan) -> LogProbsResult:
        h.set_phase("forward")
        parts = await self._on_all_ranks("logprobs", ray.put(plan), req.entropy, h.op.id)
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        missing = [i for i in range(len(req.sequences)) if i not in merged]
        if missing:
            raise WorkerError(f"no rank reported log-probs of sequences {missing[:10]}")
        ordered = [merged[i] for i in range(len(req.sequences))]
        return LogProbsResult.model_construct(
            step=self.step,
            logprobs=[lp.tolist() for lp, _ in ordered],
            entropy=[ent.tolist() for _, ent in ordered] if req.entropy else None,
        )

    async def _start_profile(self, max_entries: int) -> MemoryProfileStarted:
        if self.profile_id is not None:
            raise ConflictError(f"memory profile {self.profile_id} is already recording")
        await self._on_all_ranks("start_memory_profile", max_entries)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.profile_id = f"{stamp}-step{self.step:06d}"
        return MemoryProfileStarted(profile_id=self.profile_id, ranks=len(self.ranks))

    async def _stop_profile(self) -> MemoryProfileResult:
        if self.profile_id is None:
            raise ConflictError("no memory profile is recording; start one first")
        pid, self.profile_id = self.profile_id, None
        files = await self._on_all_ranks("stop_memory_profile")
        return await asyncio.to_thread(self.profiles.save, pid, files)

    # -- reads (no queueing) -----------------------------------------------------------------

    async def list_profiles(self) -> MemoryProfileList:
        return self.profiles.list()

    async def get_profile(self, profile_id: str) -> MemoryProfileResult:
        return self.profiles.get(profile_id)

    async def read_profile_file(self, profile_id: str, name: str) -> bytes:
        return self.profiles.read(profile_id, name)

    async def metrics_text(self) -> bytes:
        return self.metrics.text()

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
