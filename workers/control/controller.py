"""The controller: one named Ray actor per served model, and its lifecycle.

It owns the rank group (``rank_group.py``: spawn, call every rank, classify failures), the
step operations (``steps.py``: plan, train, eval, log-probs, results) and everything else
that has a lifecycle: start, drain and shutdown, failure recovery, checkpoints, export,
memory profiles (``profiles.py``) and ``info``. Every call that touches the ranks is an operation
(``op_queue.py``): queued, run one at a time in arrival order, idempotent under a key, and
dispatched on its kind through the one table of operations (``api/operations.py``).

When the rank group is lost (a rank died, peers are stuck, or an optimizer update half
applied), the call fails with a retryable 503 and the lifecycle queues a rebuild from the
latest checkpoint ahead of everything else. It imports no torch: the engine lives in the ranks.

One concern, at its length: the actor's surface and lifecycle. Each method hands its work
to the collaborator that owns it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel

from trainctl.api import (
    OPERATIONS,
    AdapterList,
    CheckpointList,
    Info,
    InvalidRequestError,
    MemoryProfileList,
    MemoryProfileResult,
    ModelLimits,
    NotReadyError,
    Operation,
    OperationKind,
    RankInfo,
    RestoreInfo,
    SampleRequest,
    SampleResult,
    Served,
    TrainctlError,
    WorkerError,
)
from trainctl.workers import spans
from trainctl.workers.control.adapter_registry import Adapters
from trainctl.workers.control.checkpoints import CheckpointStore
from trainctl.workers.control.group import GroupLostError
from trainctl.workers.control.op_queue import Handle, OperationQueue, Operations, Runner
from trainctl.workers.control.profile_store import ProfileStore
from trainctl.workers.control.profiles import ProfileRecorder
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.recovery import Recovery
from trainctl.workers.control.sampler_settings import SamplerSettings
from trainctl.workers.control.samplers import Samplers
from trainctl.workers.control.saves import Saves
from trainctl.workers.control.serving import Serving, WeightsVersion
from trainctl.workers.control.staleness import Staleness
from trainctl.workers.control.steps import ModelState, Steps
from trainctl.workers.control.telemetry import SAMPLE_SPAN, ControllerMetrics, utilization
from trainctl.workers.control.timeline import Timeline
from trainctl.workers.control.trackers import TrackerLog, open_trackers
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.rank import logs
from trainctl.workers.rank.worker import RankWorker
from trainctl.workers.sampler.spec import tokenizer_of
from trainctl.workers.spans import SpanRecord

log = logging.getLogger(__name__)

CONTROLLER_NAME = "trainctl-controller"
NAMESPACE = "trainctl"
DEFAULT_MODEL_NAME = "trainctl-tiny"
"""The name the embedded default model is served under (``Info.model_name``)."""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trainctl", "megatron-core", "torch", "ray"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


@dataclass(frozen=True)
class ControllerOptions:
    """How the controller runs, besides the engine's config and the samplers' settings
    (``service/launch.py`` builds all three from ``trainctl serve``'s settings)."""

    data_root: str
    """Checkpoints, exports, profiles and adapters live under it."""
    rank_num_cpus: float
    rank_num_gpus: float = 0.0
    profile_root: str | None = None
    """Where memory profiles go (default: ``data_root/profiles``)."""
    max_queued_operations: int = 64
    checkpoint_every_steps: int = 0
    async_save: bool = False
    """Scheduled checkpoints written in the background (``Saves.save_in_background``)."""
    keep_checkpoints: int = 3
    resume: str | None = "latest"
    """At start, load ``latest`` (the latest checkpoint that loads here, if any) or the
    checkpoint of that name; None: start afresh."""
    checkpoint_format: str = "reshardable"
    """How whole-state saves are written: ``reshardable`` (any layout loads them) or
    ``per_rank`` (their own layout only)."""
    peer_recovery: bool = True
    """Rebuild a lost group from the survivors' state before a checkpoint (``peers.py``)."""
    on_node_loss: str = "wait"
    """When the live nodes cannot hold the layout after a loss: ``wait`` for them, or
    ``shrink`` to fewer DP replicas until they can (``Recovery.shrink``)."""
    metrics_log: str | None = None
    max_staleness: int | None = None
    """Refuse training data more than this many steps behind the trainer, and pace sampling
    so that none is produced (``staleness.py``); None: no bound."""


class Controller:
    """Owns the served model's lifecycle (start, drain, shutdown), the table of operations and
    ``info``; each concern is a collaborator built here: ``group`` (the ranks), ``steps`` (the
    step operations), ``adapters``, ``saves`` (checkpoints, exports), ``samplers``,
    ``recovery``, ``recorder`` (memory profiles). Plain class; ``ControllerActor`` below is its
    Ray actor."""

    def __init__(
        self,
        cfg: EngineConfig,
        options: ControllerOptions,
        samplers: SamplerSettings | None = None,
        *,
        group: RankGroup | None = None,
    ) -> None:
        """``group``: the rank group to drive (tests give a fake one); by default the real
        ``RankGroup`` of ``cfg``."""
        logs.configure()
        spans.install_from_env("controller")
        self.cfg = cfg.validate()
        root = Path(options.data_root)
        self.profiles = ProfileStore(options.profile_root or str(root / "profiles"))
        self.checkpoints = CheckpointStore(root / "checkpoints", keep=options.keep_checkpoints)
        self.checkpoint_every_steps = options.checkpoint_every_steps
        self.async_save = options.async_save
        self.resume = options.resume
        self.resumed: RestoreInfo | None = None
        self.on_gpus = options.rank_num_gpus > 0
        self.group: RankGroup = group or RankGroup(
            self.cfg, num_cpus=options.rank_num_cpus, num_gpus=options.rank_num_gpus
        )
        self.state = ModelState()
        self.version = WeightsVersion(self.group, self.state)
        self.serving = Serving()
        self.traces = Timeline(self.group, engines=self._engine_spans)
        m = self.cfg.model
        self.limits = ModelLimits(
            vocab_size=m.vocab_size,
            max_seq_len=m.max_seq_len,
            num_layers=m.num_layers,
            num_experts=m.num_experts,
            moe_topk=m.moe_topk if m.num_experts else 0,
            tokenizer=bool(samplers and samplers.pool.num_samplers)
            and tokenizer_of(self.cfg.init_hf) is not None,
        )
        self.adapters = Adapters(self.cfg, self.group)
        self.queue = OperationQueue(max_queued=options.max_queued_operations)
        self.metrics = ControllerMetrics(lambda: self.queue.depth, lambda: self.queue.evicted)
        self.staleness = Staleness(
            options.max_staleness,
            tracks_samplers=bool(samplers and samplers.pool.num_samplers),
            observe=self.metrics.observe_staleness,
        )
        self.steps = Steps(
            self.group, self.state, after_train=self._after_train,
            adapter_state=self.adapters.state if self.cfg.lora.enabled else None,
            staleness=self.staleness, recover=lambda h, cause: self.recovery.now(h, cause),
        )  # fmt: skip
        self.recorder = ProfileRecorder(self.group, self.profiles, self.state)
        self.start_lock = asyncio.Lock()
        self.operations = Operations(self.queue, self._prepare, self.serving.check)
        self.samplers = Samplers(
            cfg=self.cfg, limits=self.limits, group=self.group, state=self.state,
            settings=samplers or SamplerSettings(), metrics=self.metrics,
            adapters=self.adapters, serving=self.serving, staleness=self.staleness,
        )  # fmt: skip
        self.saves = Saves(
            checkpoints=self.checkpoints, export_root=root / "exports",
            group=self.group, state=self.state, adapters=self.adapters, version=self.version,
            after_load=self.samplers.sync_after_load,
            reshardable=options.checkpoint_format == "reshardable",
            precision=self.cfg.resolved_precision(cuda=options.rank_num_gpus > 0),
            after_commit=lambda: self.recovery.grow_soon(),
        )  # fmt: skip
        self.recovery = Recovery(
            serving=self.serving, group=self.group, queue=self.queue, state=self.state,
            adapters=self.adapters, saves=self.saves, samplers=self.samplers,
            version=self.version, info=self.info, from_peers=options.peer_recovery,
            shrink=options.on_node_loss == "shrink",
        )  # fmt: skip
        self.queue.listeners.append(self.metrics.observe)
        self.trackers = TrackerLog(open_trackers(options.metrics_log, root), utilization)
        self.queue.listeners.append(self._track)
        self._handlers: dict[OperationKind, Any] = {
            OperationKind.TRAIN_BATCH: self.steps.train,
            OperationKind.EVAL_BATCH: self.steps.eval,
            OperationKind.LOGPROBS: self.steps.logprobs,
            OperationKind.FORWARD_BACKWARD: self.steps.forward_backward,
            OperationKind.OPTIM_STEP: self.steps.optim_step,
            OperationKind.START_MEMORY_PROFILE: self.recorder.start,
            OperationKind.STOP_MEMORY_PROFILE: self.recorder.stop,
            OperationKind.SAVE_CHECKPOINT: self.saves.save_op,
            OperationKind.LOAD_CHECKPOINT: self.saves.load_op,
            OperationKind.EXPORT_HF: self.saves.export_op,
            OperationKind.SYNC_WEIGHTS: self.samplers.sync_op,
            OperationKind.CREATE_ADAPTER: self.samplers.create_adapter_op,
            OperationKind.DELETE_ADAPTER: self.samplers.delete_adapter_op,
            OperationKind.DELETE_CHECKPOINT: self.saves.delete_op,
        }

    @property
    def step(self) -> int:
        return self.state.step

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Info:
        """Place and create the rank actors, form the process group, build every shard, and
        resume from the latest checkpoint of this layout."""
        t0 = time.perf_counter()
        log.info("starting %d rank actors (%s)", self.group.world_size, self.cfg.layout.describe())
        await self.group.place()
        await self.group.spawn()
        self.checkpoints.sweep_partial()
        for d in self.saves.export_partials():  # a crash's leftovers
            shutil.rmtree(d, ignore_errors=True)
        if self.resume == "latest":  # the newest that proves its content and loads here
            self.resumed = await self.saves.restore_latest()
        elif self.resume is not None:  # that one, or the start fails saying why
            await self.saves.load(self.resume)
            self.resumed = RestoreInfo(checkpoint_id=self.resume)
        if self.resumed is not None and self.resumed.checkpoint_id is not None:
            log.info("resumed from checkpoint %s (step %d)", self.resumed.checkpoint_id, self.step)
        await self.samplers.start()
        self.serving.ready = True
        log.info("%d ranks ready in %.1fs", self.group.world_size, time.perf_counter() - t0)
        return await self.info()

    async def start_once(self) -> None:
        """``start`` unless the ranks are already up (a Serve redeploy reuses the controller)."""
        async with self.start_lock:
            if not self.group.ranks:
                await self.start()

    async def drain(self) -> None:
        """Refuse new work, fail what is queued, and let the operation in flight finish."""
        self.serving.draining = True
        n = self.queue.fail_pending(NotReadyError("the service is shutting down"))
        if n:
            log.info("failed %d queued operation(s): shutting down", n)
        await self.queue.idle()
        if self.samplers.pool is not None:
            await self.samplers.pool.drain()

    async def shutdown(self, checkpoint: bool = False) -> None:
        """Drain; with ``checkpoint``, save the training state if it changed since the last
        checkpoint; then stop every rank."""
        await self.drain()
        if checkpoint and self.serving.ready and self.step != self.state.last_checkpoint_step:
            try:
                saved = await self.saves.save()
                log.info("saved checkpoint %s on the way out", saved.checkpoint_id)
            except Exception:
                log.exception("could not save a checkpoint on shutdown")
        await self.saves.flight.settle()  # a background save is committed before the ranks go
        self.group.kill(release=True)
        if self.samplers.pool is not None:
            self.samplers.pool.kill()
        self.trackers.close()
        self.serving.ready = False

    # -- operations --------------------------------------------------------------------------

    async def submit(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Operation:
        """Queue an operation, or return the one already submitted under ``key``; ``trace``:
        the gateway's ``traceparent``, which the operation's spans join."""
        return await self.operations.submit(kind, req, key, fingerprint, trace)

    async def run(
        self,
        kind: OperationKind,
        req: Any = None,
        key: str | None = None,
        fingerprint: str = "",
        trace: str | None = None,
    ) -> Any:
        """``submit`` and wait: the operation's result, or its error raised."""
        return await self.operations.run(kind, req, key, fingerprint, trace)

    async def operation(self, op_id: str, wait_s: float = 0.0) -> Operation:
        """The operation's state; with ``wait_s``, once finished or after that many seconds."""
        return await self.operations.operation(op_id, wait_s)

    async def _prepare(self, kind: OperationKind, req: BaseModel | None) -> Runner:
        """Validate (and plan) ``req`` now; return what runs it in its turn. A batch is
        planned on a worker thread: however large, it never stalls the controller's event
        loop (readiness, polls, other submissions)."""
        spec = OPERATIONS.get(OperationKind(kind))
        handler = self._handlers.get(OperationKind(kind))
        if spec is None or handler is None or not isinstance(req, spec.request):
            raise InvalidRequestError(f"no operation {kind!r} taking {type(req).__name__}")
        run: Runner = await asyncio.to_thread(handler, req) if spec.batch else handler(req)

        async def guarded(h: Handle) -> Any:
            try:
                return await run(h)
            except GroupLostError as e:
                self.recovery.begin(e.cause)
                raise

        return guarded

    def _track(self, h: Handle) -> None:
        """A finished operation's step metrics, to the trackers of ``--metrics-log``."""
        if h.exc is None:
            self.trackers.observe(h.op.kind, h.op.result)

    async def _after_train(self, h: Handle, adapter: str | None) -> list[str]:
        """After an applied step: the scheduled checkpoint (the base's steps count), then the
        samplers' sync of what stepped. The step stands whatever happens here, so a failure is
        a warning beside its result, never the call's error (which a client would retry,
        applying the step again)."""
        warnings = []
        if adapter is None:
            warnings = [w for w in (await self._scheduled_checkpoint(h),) if w]
        if self.serving.ready:  # not while the ranks are being restored
            warning = await self.samplers.sync_after_change(adapter)
            if warning:
                warnings.append(warning)
        return warnings

    async def _scheduled_checkpoint(self, h: Handle) -> str | None:
        if not self.checkpoint_every_steps or self.step % self.checkpoint_every_steps:
            return None
        try:
            if self.async_save:
                await self.saves.save_in_background(h)
            else:
                await self.saves.save(h)
        except GroupLostError as e:
            self.recovery.begin(e.cause)
            return (
                f"step {self.step} was applied, but a rank was lost while its scheduled "
                f"checkpoint was written ({e.cause}); the workers are being restored from "
                "the latest checkpoint"
            )
        except Exception as e:
            log.exception("scheduled checkpoint of step %d failed", self.step)
            message = e.message if isinstance(e, TrainctlError) else f"{type(e).__name__}: {e}"
            return f"step {self.step} was applied, but its scheduled checkpoint failed: {message}"
        return None

    async def list_checkpoints(self, owner: str | None = None) -> CheckpointList:
        return self.checkpoints.scoped(owner).list()

    async def list_adapters(self) -> AdapterList:
        return self.adapters.list()

    async def inject_fault(self, rank: int, phase: str, times: int, kill: bool = False) -> None:
        if not 0 <= rank < self.group.world_size:
            raise InvalidRequestError(f"rank: {rank} is not in [0, {self.group.world_size})")
        try:
            await self.group.call_one(rank, RankWorker.inject_fault, phase, times, kill)
        except WorkerError as e:
            raise InvalidRequestError(f"phase: {e.message.split(': ', 2)[-1]}") from None

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
        """What is served. While ready, every rank's digest is read, and a rank that cannot
        answer is an error (never an empty digest); while the workers are rebuilt the digests
        are null, so that ``info`` keeps answering."""
        meta = self.group.meta
        digests: list[str] | None = await self.version.digests() if self.serving.ready else None
        per_rank: list[str | None] = [None] * len(meta) if digests is None else [*digests]
        cfg = self.cfg
        return Info(
            model_name=self._model_name(),
            model=dict(cfg.to_dict()["model"]),
            layout=self.saves.layout(),
            configured_layout=dict(cfg.to_dict()["layout"]),
            engine={
                "max_tokens_per_microbatch": cfg.max_tokens_per_microbatch,
                "logprob_chunk_size": cfg.resolved_chunk_size(cuda=self.on_gpus),
                "norm_kernel": cfg.resolved_norm_kernel(cuda=self.on_gpus),
                "lr": cfg.optimizer.lr,
                "clip_grad": cfg.optimizer.clip_grad,
                "weight_decay": cfg.optimizer.weight_decay,
                "parameters_per_replica": self.group.parameters_per_replica(),
            },
            world_size=self.group.world_size,
            step=self.step,
            weights_digest=None if digests is None else self.group.digest_of(digests),
            ranks=[  # while recovering: no digests (the ranks may be gone)
                RankInfo(
                    rank=m.coords.rank,
                    coords=m.coords.grid(),
                    weights_digest=d,
                    pid=m.pid,
                    node=m.node,
                )
                for m, d in zip(meta, per_rank, strict=True)
            ],
            versions=_versions(),
            limits=self.limits,
            recovery=self.recovery.last,
            steps_lost=self.recovery.steps_lost,
            save_in_flight=self.saves.flight.info(),
            last_save_error=self.saves.flight.last_error,
            resumed=self.resumed,
            samplers=(await self.served()).samplers,
        )

    def _model_name(self) -> str:
        return Path(self.cfg.init_hf).name if self.cfg.init_hf else DEFAULT_MODEL_NAME

    async def served(self) -> Served:
        """The model's name and the samplers' versions, from the controller alone: what a
        sampling client's creation needs, without ``info``'s digests from every rank."""
        pool = self.samplers.pool
        return Served(model_name=self._model_name(), samplers=None if pool is None else pool.info())

    async def is_ready(self) -> bool:
        return self.serving.taking_work

    async def sampler_statuses(self) -> dict[str, int] | None:
        """The sampler engines counted by status (None: no samplers)."""
        return None if self.samplers.pool is None else self.samplers.pool.statuses()

    async def sample(
        self, req: SampleRequest, queue: bool = False, trace: str | None = None
    ) -> SampleResult:
        """``trace``: the caller's ``traceparent``: the sample is one span of that trace here,
        and the engine's spans are its children."""
        with spans.span(SAMPLE_SPAN, parent=trace, adapter=req.adapter) as current:
            result = await self.samplers.sample(req, queue)
            current.set_attribute("step", result.step)
            return result

    async def check_sample_room(self, req: SampleRequest) -> None:
        self.samplers.check_room(req)

    async def model_limits(self) -> ModelLimits:
        return self.limits

    async def _engine_spans(self, since: float, until: float) -> spans.Found:
        """The sampler engines' part of the timeline (none without engines)."""
        pool = self.samplers.pool
        return ([], 0) if pool is None else await pool.recent_spans(since, until)

    async def clock(self) -> float:
        """This process's wall clock: the gateway takes the controller's offset from it."""
        return spans.now()

    async def timeline(self, since: float, until: float) -> tuple[list[SpanRecord], int]:
        """The spans of the controller, every rank and every sampler engine overlapping
        ``[since, until]`` (this process's clock), on that clock, and the count their rings
        dropped."""
        return await self.traces.spans(since, until)


ControllerActor: Any = ray.remote(Controller)  # a Ray actor class: .options(...).remote(...)
