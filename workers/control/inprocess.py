"""One rank's engine in this process, without Ray: the GPU tier's and the GPU benchmark's entry
point, and a way to run the engine in a notebook or a profiler.

    engine = InProcessEngine(EngineConfig(model=..., precision="bf16"))
    result = engine.train_batch(TrainBatchRequest(sequences=[{"tokens": [...]}]))

The process group is this process alone (a ``HashStore``: no rendezvous, no port), on the
backend the rank actors use (``rank.process_group_backend``). On CUDA the engine takes the
current device (device 0 unless the caller set another). The layout must be one rank; a
multi-rank layout needs the rank actors (``trainctl serve``).

It drives the same ``RankWorker`` as a rank actor, with the controller's planning and result
merging (``plan.plan_step``, ``results``), so its numbers are the service's. What it leaves out
is the service: no queue, no checkpoints on a schedule, no recovery.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainctl.api import (
    EvalBatchRequest,
    LogProbsRequest,
    LogProbsResult,
    LossConfig,
    StepResult,
    TrainBatchRequest,
)
from trainctl.workers.control.batch import StepPlan
from trainctl.workers.control.plan import plan_step
from trainctl.workers.control.rank import RankWorker, process_group_backend
from trainctl.workers.control.results import logprobs_result, nonfinite_norm_error, step_result
from trainctl.workers.engine.config import EngineConfig


def init_single_process(backend: str = "auto", timeout_s: float = 120.0) -> None:
    """``torch.distributed`` for a world of one (nothing to do if it is already that)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"torch.distributed already spans {dist.get_world_size()} processes: "
                "the in-process engine needs a world of one"
            )
        return
    dist.init_process_group(
        backend=process_group_backend(backend, cuda=torch.cuda.is_available()),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout_s),
    )


class InProcessEngine:
    """The engine of a one-rank layout, driven by the API's own requests."""

    def __init__(self, cfg: EngineConfig, *, num_threads: int | None = None) -> None:
        cfg = cfg.validate()
        if cfg.layout.world_size != 1:
            raise ValueError(
                f"layout.world_size is {cfg.layout.world_size}: the in-process engine runs "
                "one rank (dp = cp = tp = pp = ep = 1); serve larger layouts with `trainctl serve`"
            )
        init_single_process(cfg.backend, cfg.collective_timeout_s)
        self.worker = RankWorker(0, 1, num_threads=num_threads or torch.get_num_threads())
        self.worker.build(cfg.to_dict())
        self.cfg: EngineConfig = self.worker.engine.cfg
        self.step = 0

    @property
    def engine(self) -> Any:
        """The ``EngineShard`` (its model chunks, optimizer and profiler)."""
        return self.worker.engine

    def _plan(self, req: TrainBatchRequest | EvalBatchRequest) -> tuple[StepPlan, float]:
        t0 = time.perf_counter()
        plan = plan_step(list(req.sequences), self.cfg, loss=req.loss, packing=req.packing)
        return plan, time.perf_counter() - t0

    def train_batch(self, req: TrainBatchRequest) -> StepResult:
        """Forward/backward and the optimizer step; a non-finite gradient norm applies
        nothing (as in the service)."""
        req.check_expected_step(self.step)
        t0 = time.perf_counter()
        plan, t_plan = self._plan(req)
        report = self.worker.accumulate(plan)
        error = nonfinite_norm_error([report.grad_norm])
        if error is not None:
            self.worker.discard()
            raise error
        grad_norm, optimizer_s = self.worker.apply()
        self.step += 1
        result = step_result(plan, [report], step=self.step, t_plan=t_plan)
        result.metrics["grad_norm:value"] = grad_norm
        result.metrics["lr:value"] = self.cfg.optimizer.lr
        result.timings["optimizer_max_s"] = optimizer_s
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    def eval_batch(self, req: EvalBatchRequest) -> StepResult:
        t0 = time.perf_counter()
        plan, t_plan = self._plan(req)
        result = step_result(plan, [self.worker.eval_batch(plan)], step=self.step, t_plan=t_plan)
        result.timings["total_s"] = time.perf_counter() - t0
        return result

    def logprobs(self, req: LogProbsRequest) -> LogProbsResult:
        tokens_only = req.sequences.without(*req.sequences.present)
        plan = plan_step(list(tokens_only), self.cfg, loss=LossConfig(), packing=req.packing)
        parts = [self.worker.logprobs(plan, req.entropy)]
        return logprobs_result(
            parts, plan, n=len(req.sequences), entropy=req.entropy, step=self.step
        )

    def start_memory_profile(self, max_entries: int = 100_000) -> None:
        """Record allocations (CUDA: the allocator's history; CPU: the profiler's events)."""
        self.worker.start_memory_profile(max_entries)

    def stop_memory_profile(self, directory: Path) -> Path:
        """Stop recording and write the profile into ``directory``: a snapshot pickle on CUDA
        (pytorch.org/memory_viz opens it), a Chrome trace on CPU. Returns its path."""
        return Path(self.engine.profiler.stop(Path(directory)))

    def close(self) -> None:
        """Free the model and the optimizer (the process group stays, for the next engine:
        each builds its parallel state anew)."""
        self.engine.close()
        self.worker.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
