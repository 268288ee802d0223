"""The controller: one named Ray actor per served model.

It owns the rank actors (one per global rank, in a placement group), plans each step on the
host (``workers/control/plan.py``), puts the plan in the object store once, fans it out to
every rank and merges the ranks' reports into one result. Every call that touches the ranks is
an operation (``workers/control/operations.py``): queued, run one at a time in arrival order,
idempotent under a key. It imports no torch: the engine lives in the rank actors.

A train step has two phases so that no rank applies a step another rank failed: every rank
accumulates gradients; only if all succeed does every rank apply the optimizer step. If any
fails, all drop their gradients and the error names the rank and its cause.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import shutil
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
    CheckpointInfo,
    CheckpointList,
    EvalBatchRequest,
    ExportRequest,
    ExportResult,
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
    RecoveryInfo,
    StepResult,
    TrainBatchRequest,
    WorkerError,
)
from trainctl.api import Sequence as ApiSequence
from trainctl.api.errors import ConflictError, TrainctlError
from trainctl.api.models import LossConfig
from trainctl.workers.control import logs
from trainctl.workers.control.batch import HostSequence, LossSpec, StepPlan
from trainctl.workers.control.checkpoints import CheckpointStore
from trainctl.workers.control.operations import Handle, OperationHost, OperationQueue
from trainctl.workers.control.plan import plan_step
from trainctl.workers.control.profile_store import ProfileStore
from trainctl.workers.control.rank import RankWorker
from trainctl.workers.control.telemetry import ControllerMetrics
from trainctl.workers.engine.config import ConfigError, EngineConfig

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
RECOVERY_RETRY_S = 15.0
FAILURE_GRACE_S = 10.0
"""After one rank fails, how long the others may take before the group counts as wedged."""
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
        data_root: str | None = None,
        checkpoint_every_steps: int = 0,
        keep_checkpoints: int = 3,
        resume: bool = True,
    ) -> None:
        logs.configure()
        self.cfg = EngineConfig.from_dict(cfg).validate()
        self.profiles = ProfileStore(profile_root)
        root = Path(data_root) if data_root else Path(profile_root).parent
        self.checkpoints = CheckpointStore(root / "checkpoints", keep=keep_checkpoints)
        self.export_root = root / "exports"
        self.checkpoint_every_steps = checkpoint_every_steps
        self.resume = resume
        self.recovery: RecoveryInfo | None = None
        self.steps_lost = 0
        self.last_checkpoint_step: int | None = None
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
        await self._spawn_ranks()
        self.checkpoints.sweep_partial()
        latest = self._latest_checkpoint()
        if self.resume and latest is not None:
            await self._load(latest.checkpoint_id)
            log.info("resumed from checkpoint %s (step %d)", latest.checkpoint_id, self.step)
        self.ready = True
        log.info("%d ranks ready in %.1fs", world, time.perf_counter() - t0)
        return await self.info()

    async def _spawn_ranks(self) -> None:
        """Create one rank actor per bundle, form the process group, build every shard."""
        world = self.cfg.layout.world_size
        actor_cls = ray.remote(RankWorker)
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        self.ranks = [
            actor_cls.options(
                num_cpus=self.rank_num_cpus,
                num_gpus=self.rank_num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env},
            ).remote(i, world)
            for i in range(world)
        ]
        timeout = self.cfg.collective_timeout_s
        host, port = await self.ranks[0].rendezvous_address.remote(timeout)
        await asyncio.gather(
            *[
                r.init_process_group.remote(host, port, self.cfg.backend, timeout)
                for r in self.ranks
            ]
        )
        log.info("process group formed at %s:%d; building engine shards", host, port)
        self.rank_meta = await asyncio.gather(
            *[r.build.remote(self.cfg.to_dict()) for r in self.ranks]
        )

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

    async def shutdown(self, checkpoint: bool = False) -> None:
        """Drain; with ``checkpoint``, save the training state if it changed since the last
        checkpoint; then stop every rank."""
        await self.drain()
        if checkpoint and self.ready and self.step != self.last_checkpoint_step:
            try:
                saved = await self._save()
                log.info("saved checkpoint %s on the way out", saved.checkpoint_id)
            except Exception:
                log.exception("could not save a checkpoint on shutdown")
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
        if kind == "checkpoint_save":
            return lambda h: self._save(h)
        if kind == "checkpoint_load" and isinstance(req, str):
            self.checkpoints.path(req)  # 404 now, not once queued
            return lambda h: self._load(req, h)
        if kind == "export_hf" and isinstance(req, ExportRequest):
            if self.cfg.model.num_experts:
                raise InvalidRequestError("MoE models cannot be exported as Llama checkpoints")
            return lambda h: self._export(req, h)
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
        """Call ``method`` on every rank; a failure names each failing rank and its cause.

        A dead rank, or peers still blocked (in a collective) ``FAILURE_GRACE_S`` after a
        rank failed, mean the process group is lost: the workers are rebuilt from the latest
        checkpoint (a ``recover`` operation, next in the queue) and the call gets a retryable
        503 at once.
        """
        tasks = [asyncio.ensure_future(getattr(r, method).remote(*args)) for r in self.ranks]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
        failed = {
            rank: t.exception()
            for rank, t in enumerate(tasks)
            if t.done() and t.exception() is not None
        }
        if not failed and not pending:
            return [t.result() for t in tasks]
        for t in pending:
            t.cancel()
        dead = [r for r, e in failed.items() if isinstance(e, ray.exceptions.RayActorError)]
        causes = {
            rank: f"{type(c).__name__}: {c}"
            for rank, e in failed.items()
            for c in [getattr(e, "cause", None) or e]
        }
        if dead or pending:
            what = f"rank(s) {dead} died" if dead else f"rank(s) {sorted(causes)} failed"
            stuck = f", {len(pending)} rank(s) stuck" if pending else ""
            cause = f"{what} during {method}{stuck}"
            self._begin_recovery(cause)
            err = NotReadyError(
                f"{cause}; nothing was applied. The workers are being rebuilt from the latest "
                "checkpoint: retry shortly",
                details={"ranks": dead or sorted(causes), "method": method, "causes": causes},
            )
            raise err
        for e in failed.values():
            c = getattr(e, "cause", None)
            if isinstance(c, TrainctlError):
                raise c
        first = min(causes)
        raise WorkerError(
            f"rank {first} failed in {method}: {causes[first]}"
            + (f" (and {len(causes) - 1} more rank(s))" if len(causes) > 1 else ""),
            details={"method": method, "ranks": {str(r): c for r, c in causes.items()}},
        )

    # -- failure recovery --------------------------------------------------------------------

    def _begin_recovery(self, cause: str) -> None:
        """Stop taking work and queue the rebuild ahead of everything else."""
        if not self.ready:
            return  # already recovering
        self.ready = False
        log.error("worker group lost (%s): rebuilding", cause)
        self._queue_recovery(cause, self.step)

    def _queue_recovery(self, cause: str, step_before: int) -> None:
        if not self.draining:
            run = lambda h: self._recover(h, cause, step_before)  # noqa: E731
            self.queue.submit("recover", run, front=True)

    async def _recover(self, h: Handle, cause: str, step_before: int) -> Info:
        """Replace every rank actor and restore the latest checkpoint; retried while it fails
        (e.g. the cluster has no room yet for a replacement)."""
        try:
            return await self._rebuild(h, cause, step_before)
        except Exception:
            log.exception("recovery failed; trying again in %.0fs", RECOVERY_RETRY_S)
            loop = asyncio.get_running_loop()
            loop.call_later(RECOVERY_RETRY_S, self._queue_recovery, cause, step_before)
            raise

    async def _rebuild(self, h: Handle, cause: str, step_before: int) -> Info:
        h.set_phase("rebuilding workers")
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        await self._spawn_ranks()
        latest = self._latest_checkpoint()
        if latest is not None:
            h.set_phase(f"restoring {latest.checkpoint_id}")
            await self._load(latest.checkpoint_id)
        else:
            self.step = 0
        self.recovery = RecoveryInfo(
            at=time.time(),
            cause=cause,
            restored_checkpoint=latest.checkpoint_id if latest else None,
            step_before=step_before,
            step_after=self.step,
        )
        self.steps_lost += step_before - self.step
        self.ready = True
        log.warning(
            "recovered: at step %d (was %d; %d step(s) lost)",
            self.step,
            step_before,
            step_before - self.step,
        )
        return await self.info()

    # -- checkpoints -------------------------------------------------------------------------

    def _latest_checkpoint(self) -> CheckpointInfo | None:
        layout = self.cfg.to_dict()["layout"]
        found = [c for c in self.checkpoints.list().checkpoints if c.layout == layout]
        return found[-1] if found else None

    async def _save(self, h: Handle | None = None) -> CheckpointInfo:
        if h is not None:
            h.set_phase("writing checkpoint")
        tmp = self.checkpoints.begin(self.step)
        try:
            await self._on_all_ranks("save_checkpoint", str(tmp))
            digest = await self._replica_digest()
            info = {
                "step": self.step,
                "layout": self.cfg.to_dict()["layout"],
                "weights_digest": digest,
            }
            saved = await asyncio.to_thread(self.checkpoints.commit, tmp, info)
        except BaseException:
            self.checkpoints.abort(tmp)
            raise
        self.last_checkpoint_step = self.step
        return saved

    async def _load(self, checkpoint_id: str, h: Handle | None = None) -> CheckpointInfo:
        path, info = self.checkpoints.path(checkpoint_id)
        if info.layout != self.cfg.to_dict()["layout"]:
            raise ConflictError(
                f"checkpoint {checkpoint_id} was saved with layout {info.layout}; this service "
                f"runs {self.cfg.to_dict()['layout']}"
            )
        if h is not None:
            h.set_phase(f"loading {checkpoint_id}")
        await self._on_all_ranks("load_checkpoint", str(path))
        self.step = info.step
        self.last_checkpoint_step = info.step
        return info

    async def _export(self, req: ExportRequest, h: Handle) -> ExportResult:
        name = req.name or f"step-{self.step:06d}"
        target = self.export_root / name
        tmp = self.export_root / f".partial-{name}-{os.getpid()}"
        h.set_phase("gathering weights")
        parts = [r.canonical_shards.remote() for r in self._replica0(self.ranks)]
        h.set_phase("writing safetensors")
        files = await self.ranks[0].write_hf.remote(str(tmp), parts)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        return ExportResult(
            name=name,
            step=self.step,
            path=str(target),
            files={f["name"]: f["size_bytes"] for f in files},
        )

    async def list_checkpoints(self) -> CheckpointList:
        return self.checkpoints.list()

    async def inject_fault(self, rank: int, phase: str, times: int) -> None:
        if not 0 <= rank < len(self.ranks):
            raise InvalidRequestError(f"rank: {rank} is not in [0, {len(self.ranks)})")
        try:
            await self.ranks[rank].inject_fault.remote(phase, times)
        except ray.exceptions.RayTaskError as e:
            raise InvalidRequestError(f"phase: {e.cause}") from None

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
        req.check_expected_step(self.step)
        t0 = time.perf_counter()
        ref = ray.put(plan)
        h.set_phase("forward_backward")
        try:
            reports = await self._on_all_ranks("accumulate", ref, h.op.id)
        except TrainctlError:
            await self._discard()
            raise
        norms = [r.grad_norm for r in reports]
        if not all(n is not None and math.isfinite(n) for n in norms):
            await self._discard()
            raise WorkerError(
                f"the gradient norm is not finite ({norms[0]}); the step was not applied",
                details={"grad_norm": str(norms[0])},
            )
        h.set_phase("optimizer_step")
        try:
            applied = await self._on_all_ranks("apply", h.op.id)
        except WorkerError as e:
            # Some ranks may have applied the update and others not: only a restore makes
            # them agree again, so the step is rolled back with everything since the checkpoint.
            cause = f"{e.message} (in the optimizer update)"
            self._begin_recovery(cause)
            raise NotReadyError(
                f"{cause}; the workers are being restored from the latest checkpoint, so the "
                "step is not applied: retry shortly",
                details=e.details,
            ) from None
        self.step += 1
        if self.checkpoint_every_steps and self.step % self.checkpoint_every_steps == 0:
            await self._save(h)
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

    async def _replica_digest(self) -> str:
        digests = await self._on_all_ranks("weights_digest")
        return self._digest_of(digests)

    def _replica0(self, per_rank: list[Any]) -> list[Any]:
        """The items of ``per_rank`` (one per rank, in rank order) of DP x CP replica 0: one
        full copy of the model across TP and PP."""
        return [
            item
            for item, m in zip(per_rank, self.rank_meta, strict=True)
            if m["coords"]["dp"] == 0 and m["coords"]["cp"] == 0
        ]

    def _digest_of(self, digests: list[str]) -> str:
        return hashlib.sha256("".join(self._replica0(digests)).encode()).hexdigest()

    async def info(self) -> Info:
        """What is served. While ready, every rank's digest is read, and a rank that cannot
        answer is an error (never an empty digest); while the workers are rebuilt the digests
        are null, so that ``info`` keeps answering."""
        digests: list[str] | None = None
        if self.ready:
            digests = await self._on_all_ranks("weights_digest")
        per_rank: list[str | None] = [None] * len(self.rank_meta) if digests is None else [*digests]
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
                    m["parameters"] for m in self._replica0(self.rank_meta)
                ),
            },
            world_size=cfg.layout.world_size,
            step=self.step,
            weights_digest=None if digests is None else self._digest_of(digests),
            ranks=[  # while recovering: no digests (the ranks may be gone)
                RankInfo(rank=m["rank"], coords=m["coords"], weights_digest=d, pid=m.get("pid"))
                for m, d in zip(self.rank_meta, per_rank, strict=True)
            ],
            versions=_versions(),
            limits=self.limits,
            recovery=self.recovery,
            steps_lost=self.steps_lost,
        )

    async def is_ready(self) -> bool:
        return self.ready and not self.draining

    async def model_limits(self) -> ModelLimits:
        return self.limits


ControllerActor = ray.remote(Controller)
