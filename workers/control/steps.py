"""The step operations: ``train_batch``, ``eval_batch`` and ``logprobs``.

Each is planned when it is submitted (the gateway has checked it against the model's limits;
a batch the layout cannot take is refused here, before it queues) and run later, in its turn,
on the rank group. The plan travels to the ranks once, through the object store, and their
reports are merged into one result.

A train step has phases so that no rank applies a step another rank failed, and no rank waits
in a collective for a rank that already failed:

1. every rank accumulates gradients and the global norm (all the step's collectives but one);
2. only if all succeed (and the norm is finite), every rank applies the optimizer update to
   what it owns: local arithmetic, no collective;
3. under ZeRO-1 only, once every rank's update succeeded: the all-gather of the updated
   parameter shards.

If phase 1 fails, all drop their gradients: the step is applied nowhere. If phase 2 or 3 fails
on some rank, the ranks may disagree (some updated, some not; or a gather cut short), so the
group is rebuilt at once, inside the call (``recover``): from the survivors' state when they
agree, and then the step stands if they had all applied it (the call answers its result, so
its idempotency key keeps it: a retry never applies it twice) and is not applied if none had;
else from the latest checkpoint, where the step is applied nowhere. Phase 3 never starts after
a failed phase 2, so a failed update costs no collective timeout.

One concern, at its length: the phases of a step and what a failure in each leaves behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from trainctl.api import (
    ConflictError,
    EvalBatchRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    InvalidRequestError,
    LogProbsRequest,
    LogProbsResult,
    LossConfig,
    Normalization,
    NotReadyError,
    OptimStepRequest,
    RecoveryInfo,
    StepResult,
    TrainBatchRequest,
    TrainctlError,
    WorkerError,
)
from trainctl.api.batch import SequenceBatch
from trainctl.api.errors import field_error
from trainctl.workers import spans
from trainctl.workers.control.group import Group, GroupLostError
from trainctl.workers.control.op_queue import Handle, Runs
from trainctl.workers.control.plan import plan_step
from trainctl.workers.control.results import (
    in_request_order,
    logprobs_result,
    nonfinite_norm_error,
    step_result,
)
from trainctl.workers.control.staleness import Staleness
from trainctl.workers.engine.config import EngineConfig, OptimizerConfig
from trainctl.workers.rank.step_plan import StepPlan
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)


@dataclass
class Window:
    """The split step's gradients waiting for ``optim_step``: what the ranks have summed
    since the last step (docs/algorithms.md §11)."""

    normalization: Normalization
    parts: int = 0
    loss_tokens: int = 0
    loss_sequences: int = 0
    raw_loss: float = 0.0
    """The parts' losses summed before the window's division."""
    staleness: dict[str, float] = field(default_factory=dict)
    """The parts' staleness metrics, merged (``optim_step`` reports them for its step)."""

    stale_parts: int = 0
    """The parts whose sequences carried their steps."""

    def add_staleness(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        self.stale_parts += 1
        n = self.stale_parts
        for k, v in metrics.items():
            old = self.staleness.get(k)
            if k == "staleness:mean":  # the mean of the parts' means
                v = v if old is None else (old * (n - 1) + v) / n
            elif old is not None:
                v = max(old, v) if k == "staleness:max" else old + v
            self.staleness[k] = v

    def divisor(self) -> float:
        """What the summed gradients are divided by once: the union's normaliser."""
        return normalizer(self.normalization, self.loss_tokens, self.loss_sequences)


def _norm(norms: list[float | None]) -> float:
    """Phase 1's global gradient norm (every rank that computed one has the same)."""
    return next((n for n in norms if n is not None), 0.0)


def normalizer(normalization: Normalization, loss_tokens: int, loss_sequences: int) -> float:
    """The batch-wide divisor that a deferred plan (``plan.sequence_scales``) leaves out."""
    if normalization is Normalization.TOKEN_MEAN:
        return float(max(loss_tokens, 1))
    if normalization is Normalization.SEQ_MEAN_TOKEN_MEAN:
        return float(max(loss_sequences, 1))
    return 1.0


Planned = Callable[[], Awaitable[tuple[StepPlan, float]]]
"""A call's dispatch plan and the seconds it took, for the layout the ranks run when asked."""


@dataclass
class ModelState:
    """What the controller knows of the model the ranks hold."""

    step: int = 0
    """Optimizer steps applied (the policy version)."""
    last_checkpoint_step: int | None = None
    window: Window | None = None
    """Gradients of ``forward_backward`` parts waiting for ``optim_step``."""


class Steps:
    """The one step sequence. Owns nothing but the order of a step's calls; the weights' version
    is the ``ModelState`` it is given, the ranks hold the tensors."""

    def __init__(
        self,
        group: Group,
        state: ModelState,
        *,
        after_train: Callable[[Handle, str | None], Awaitable[list[str]]],
        adapter_state: Callable[[str], ModelState] | None = None,
        staleness: Staleness | None = None,
        recover: Callable[[Handle, str], Awaitable[RecoveryInfo]] | None = None,
    ) -> None:
        self.group, self.state = group, state
        self.staleness = staleness or Staleness(None, tracks_samplers=False)
        """The steps a batch claims, checked when its call runs (``staleness.py``)."""
        self.after_train = after_train
        """Called after every applied step, of the base or of the adapter named (scheduled
        checkpoints, the samplers' sync); it never raises, and what it returns are warnings to
        report beside the step's result."""
        self.adapter_state = adapter_state
        """A LoRA adapter's own step and window (``workers/control/adapter_registry.py``); a name it
        does not know is a 404."""
        self.recover = recover
        """Rebuild the group now, inside the call (``Recovery.now``); None: a failed update
        is a ``GroupLostError`` and the group is rebuilt after the call."""

    @property
    def cfg(self) -> EngineConfig:
        """The config the ranks run now (its layout shrinks while a node is lost)."""
        return self.group.cfg

    def state_of(self, adapter: str | None) -> ModelState:
        """The model a call reads and steps: the base, or the adapter it names."""
        if adapter is None:
            return self.state
        if self.adapter_state is None:
            raise InvalidRequestError(
                "adapter: this service holds no adapters (start it with --max-adapters N)"
            )
        return self.adapter_state(adapter)

    # -- planning (at submit) ------------------------------------------------------------------

    def plan(
        self,
        sequences: SequenceBatch,
        loss: LossConfig,
        packing: str | None,
        *,
        deferred_normalizer: bool = False,
        adapter: str | None = None,
    ) -> tuple[StepPlan, float]:
        """The dispatch plan and the seconds it took; a batch the layout cannot take is a 422.
        ``packing``: the request's, else the server's default; ``deferred_normalizer``: a
        ``forward_backward`` part (``plan.sequence_scales``)."""
        self.state_of(adapter)  # an unknown adapter is refused before the call queues
        with spans.timed("plan", sequences=len(sequences)) as t:  # plan_s: the span's length
            try:
                plan = plan_step(
                    list(sequences), self.cfg, loss=loss, packing=packing,
                    deferred_normalizer=deferred_normalizer,
                )  # fmt: skip
            except ValueError as e:
                raise InvalidRequestError(str(e)) from e
        return dataclasses.replace(plan, adapter=adapter), t.seconds

    def _check_trainable(self, adapter: str | None) -> None:
        if adapter is None and self.cfg.lora.enabled:
            raise field_error(
                "adapter",
                "this service trains LoRA adapters on a frozen base (--max-adapters): name the "
                "adapter to train; the base alone is for forward passes",
            )

    def _planned(self, make: Callable[[], tuple[StepPlan, float]]) -> Planned:
        """``make()`` now, so that a batch the layout cannot take is refused before it
        queues; made again when the call runs if the ranks' layout changed meanwhile (a lost
        node shrank it, or it grew back: the plan splits the batch over the DP replicas), on
        a worker thread as at submit, so that a large batch never stalls the event loop."""
        layout = self.cfg.layout
        made = make()

        async def current() -> tuple[StepPlan, float]:
            return made if self.cfg.layout == layout else await asyncio.to_thread(make)

        return current

    def train(self, req: TrainBatchRequest) -> Runs[StepResult]:
        self._check_trainable(req.adapter)
        planned = self._planned(
            lambda: self.plan(req.sequences, req.loss, req.packing, adapter=req.adapter)
        )
        return lambda h: self._train(h, req, planned)

    def eval(self, req: EvalBatchRequest) -> Runs[StepResult]:
        planned = self._planned(
            lambda: self.plan(req.sequences, req.loss, req.packing, adapter=req.adapter)
        )
        return lambda h: self._eval(h, req, planned)

    def forward_backward(self, req: ForwardBackwardRequest) -> Runs[ForwardBackwardResult]:
        if not req.forward_only:
            self._check_trainable(req.adapter)
        seqs, loss, packing, adapter = req.sequences, req.loss, req.packing, req.adapter
        planned = self._planned(
            lambda: self.plan(seqs, loss, packing, deferred_normalizer=True, adapter=adapter)
        )
        return lambda h: self._forward_backward(h, req, planned)

    def optim_step(self, req: OptimStepRequest) -> Runs[StepResult]:
        hyper = dataclasses.replace(self.cfg.optimizer, **req.overrides())
        try:
            hyper.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self._check_trainable(req.adapter)
        self.state_of(req.adapter)
        return lambda h: self._optim_step(h, req, hyper)

    def logprobs(self, req: LogProbsRequest) -> Runs[LogProbsResult]:
        """Log-probs read only the tokens (every position after the first is a target) and
        the routes to replay, if given."""
        tokens_only = req.sequences.without(
            *(k for k in req.sequences.present if k != "routed_experts")
        )
        planned = self._planned(
            lambda: self.plan(tokens_only, LossConfig(), req.packing, adapter=req.adapter)
        )
        return lambda h: self._logprobs(h, req, planned)

    # -- running (in turn) ---------------------------------------------------------------------

    async def _train(self, h: Handle, req: TrainBatchRequest, planned: Planned) -> StepResult:
        plan, t_plan = await planned()
        state = self.state_of(plan.adapter)
        req.check_expected_step(state.step)
        self._no_window(state, "train_batch")
        stale = self.staleness.check(req.sequences, state.step, plan.adapter, req.staleness)
        t0 = time.perf_counter()
        ref = self.group.put(plan)
        h.set_phase("forward_backward")
        try:
            reports = await self.group.call(RankWorker.accumulate, ref, h.ref())
        except TrainctlError:
            await self._discard(state)
            raise
        norms = [r.grad_norm for r in reports]
        await self._check_norms(state, norms)
        result = step_result(plan, reports, step=state.step, t_plan=t_plan)
        result.metrics.update(stale)
        await self._apply(h, state, result, None, plan.adapter, _norm(norms))
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    async def _check_norms(self, state: ModelState, norms: list[float | None]) -> None:
        """Phase 1's grad norm must be finite on every rank, or nothing is applied."""
        error = nonfinite_norm_error(norms)
        if error is not None:
            await self._discard(state)
            raise error

    async def _apply(
        self,
        h: Handle,
        state: ModelState,
        result: StepResult,
        hyper: OptimizerConfig | None,
        adapter: str | None,
        norm: float,
    ) -> None:
        """Phases 2 and 3 of a step (every rank's phase 1 succeeded, with global norm
        ``norm``), into ``result``."""
        h.set_phase("optimizer_step")
        before = state.step
        applied, published, rebuilt = None, None, False
        try:
            applied = await self.group.call(RankWorker.apply, h.ref(), hyper)
            if self.cfg.use_distributed_optimizer:
                # Only now that every rank has updated its shard: the all-gather.
                h.set_phase("parameter_gather")
                published = await self.group.call(RankWorker.publish, h.ref())
        except (WorkerError, GroupLostError) as e:
            # Some ranks may have applied the update and others not: only a rebuild makes
            # them agree again.
            where = "optimizer update" if h.op.phase == "optimizer_step" else "parameter all-gather"
            cause = f"{e.cause if isinstance(e, GroupLostError) else e.message} (in the {where})"
            if self.recover is None:
                raise GroupLostError(
                    f"{cause}; the workers are being restored from the latest checkpoint, so "
                    "the step is not applied: retry shortly",
                    details=e.details,
                    cause=cause,
                ) from None
            await self._rebuilt_after_update(h, cause, before, adapter)
            rebuilt = True  # the survivors' step, one more than before: counted by the rebuild
            result.warnings.append(
                f"{cause}; every rank had applied the update, so the step stands: the workers "
                "were rebuilt from the survivors' state"
            )
        state = self.state_of(adapter)  # a rebuild re-reads the adapters' records
        if not rebuilt:
            state.step += 1
        h.applied = True  # from here on the call answers its result, never a retryable error
        result.step = state.step
        t_after = time.perf_counter()
        result.warnings.extend(await self.after_train(h, adapter))
        # a scheduled checkpoint and the samplers' sync (after_step, in_flight), if any
        result.timings["after_step_s"] = time.perf_counter() - t_after
        result.metrics["grad_norm:value"] = applied[0].grad_norm if applied else norm
        result.metrics["lr:value"] = (hyper or self.cfg.optimizer).lr
        if applied is not None:
            result.timings["optimizer_max_s"] = max(a.seconds for a in applied)
        if published is not None:
            result.timings["parameter_gather_max_s"] = max(published)

    async def _rebuilt_after_update(
        self, h: Handle, cause: str, before: int, adapter: str | None
    ) -> None:
        """The group rebuilt after an update failed on some rank: returns if the step stands
        (the survivors had all applied it), else raises a retryable error (nothing applied:
        the survivors had not, or a checkpoint was restored)."""
        assert self.recover is not None
        try:
            rec = await self.recover(h, cause)
        except Exception as e:
            raise NotReadyError(
                f"{cause}; rebuilding the workers failed ({e}), so the step is not applied: "
                "retry once the service is ready"
            ) from None
        if rec.source == "peer" and self.state_of(adapter).step == before + 1:
            return
        where = (
            "the survivors' state, which had not applied it"
            if rec.source == "peer"
            else f"checkpoint {rec.restored_checkpoint}"
            if rec.restored_checkpoint
            else "the start weights"
        )
        raise NotReadyError(
            f"{cause}; the workers were rebuilt from {where}, so the step is not applied: retry it",
            details={"recovery_source": rec.source, "step": self.state_of(adapter).step},
        )

    def _no_window(self, state: ModelState, what: str) -> None:
        w = state.window
        if w is not None:
            raise ConflictError(
                f"{w.parts} forward_backward part(s) are waiting for optim_step; {what} would "
                "mix them into its own step: call optim_step first",
                details={"accumulated_parts": w.parts},
            )

    async def _forward_backward(
        self, h: Handle, req: ForwardBackwardRequest, planned: Planned
    ) -> ForwardBackwardResult:
        plan, t_plan = await planned()
        norm = req.loss.normalization
        state = self.state_of(plan.adapter)
        w = state.window
        if w is not None and w.normalization is not norm and not req.forward_only:
            raise ConflictError(
                f"the gradients waiting for optim_step use loss.normalization "
                f"'{w.normalization.value}'; this call asks for '{norm.value}': one step "
                "normalises one way",
                details={"accumulated_parts": w.parts},
            )
        backward = not req.forward_only
        stale = self.staleness.check(
            req.sequences, state.step, plan.adapter, req.staleness, training=backward
        )
        t0 = time.perf_counter()
        h.set_phase("forward" if req.forward_only else "forward_backward")
        try:
            parts = await self.group.call(
                RankWorker.forward_backward, self.group.put(plan), h.ref(), backward
            )
        except TrainctlError:
            if backward:  # ranks that finished this part take it back: the window is as before
                await self.group.call_quietly(RankWorker.rollback_part)
            raise
        reports = [p.report for p in parts]
        raw = next(r for r in reports if r.is_last_stage).loss
        own = normalizer(norm, int(plan.loss_normalizer), plan.num_loss_sequences)
        per_seq = in_request_order([p.per_sequence for p in parts], len(req.sequences))
        step = step_result(plan, reports, step=state.step, t_plan=t_plan)
        if backward:
            w = state.window = w or Window(normalization=norm)
            w.parts += 1
            w.loss_tokens += int(plan.loss_normalizer)
            w.loss_sequences += plan.num_loss_sequences
            w.raw_loss += raw
            w.add_staleness(stale)
        step.metrics["accumulated_parts:value"] = float(w.parts if w is not None else 0)
        step.metrics.update(stale)
        step.timings["total_s"] = time.perf_counter() - t0
        return ForwardBackwardResult.model_construct(
            loss=raw / own,
            step=state.step,
            logprobs=[lp.tolist() for lp, _ in per_seq],
            elementwise_loss=[tl.tolist() for _, tl in per_seq],
            metrics={**step.metrics, "loss:mean": raw / own},
            timings=step.timings,
        )

    async def _optim_step(
        self, h: Handle, req: OptimStepRequest, hyper: OptimizerConfig
    ) -> StepResult:
        state = self.state_of(req.adapter)
        req.check_expected_step(state.step)
        w = state.window
        if w is None:
            raise ConflictError("no gradients to apply: call forward_backward first")
        t0 = time.perf_counter()
        h.set_phase("gradient_reduce")
        state.window = None  # applied, or dropped: either way the window closes
        try:
            norms = await self.group.call(
                RankWorker.finish_window, w.divisor(), h.ref(), req.adapter
            )
        except TrainctlError:
            await self._discard(state)
            raise
        await self._check_norms(state, list(norms))
        norm = _norm(list(norms))
        loss = w.raw_loss / w.divisor()
        result = StepResult(
            loss=loss,
            step=state.step,
            metrics={"loss:mean": loss, "accumulated_parts:value": float(w.parts),
                     "loss_tokens:sum": float(w.loss_tokens), **w.staleness},
            timings={"gradient_reduce_s": time.perf_counter() - t0},
        )  # fmt: skip
        await self._apply(h, state, result, hyper, req.adapter, norm)
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    async def _discard(self, state: ModelState) -> None:
        """After a failed phase 1: every surviving rank drops its gradients (the active
        model's: the base's, or the adapter's that failed)."""
        state.window = None
        await self.group.call_quietly(RankWorker.discard)
        log.warning("step not applied: gradients dropped on every rank")

    async def _eval(self, h: Handle, req: EvalBatchRequest, planned: Planned) -> StepResult:
        plan, t_plan = await planned()
        step = self.state_of(plan.adapter).step
        stale = self.staleness.check(req.sequences, step, plan.adapter, training=False)
        t0 = time.perf_counter()
        h.set_phase("forward")
        reports = await self.group.call(RankWorker.eval_batch, self.group.put(plan), h.ref())
        result = step_result(plan, reports, step=step, t_plan=t_plan)
        result.metrics.update(stale)
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    async def _logprobs(self, h: Handle, req: LogProbsRequest, planned: Planned) -> LogProbsResult:
        plan, _ = await planned()
        h.set_phase("forward")
        ref = self.group.put(plan)
        parts = await self.group.call(
            RankWorker.logprobs, ref, req.entropy, req.return_routes, h.ref()
        )
        step = self.state_of(plan.adapter).step
        routes = self.cfg.model.num_layers if req.return_routes else None
        return logprobs_result(
            parts, plan, n=len(req.sequences), entropy=req.entropy, step=step, routes=routes
        )
