"""One rank's engine in this process, without Ray: the GPU tier's and the GPU benchmark's entry
point, and a way to run the engine in a notebook or a profiler.

    engine = InProcessEngine(EngineConfig(model=..., precision="bf16"))
    result = engine.train_batch(TrainBatchRequest(sequences=[{"tokens": [...]}]))

The process group is this process alone (a ``HashStore``: no rendezvous, no port), on the
backend the rank actors use (``rank.process_group_backend``). On CUDA the engine takes the
current device (device 0 unless the caller set another). The layout must be one rank; a
multi-rank layout needs the rank actors (``trainctl serve``).

It runs the controller's own step sequence (``steps.Steps``: planning, the phases, the
non-finite-norm check, result merging) over a ``LocalGroup``, one ``RankWorker`` in this
process, so its numbers and its step code are the service's. What it leaves out is the
service: no queue, no checkpoints on a schedule, no recovery.
"""

from __future__ import annotations

import asyncio
import gc
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from trainctl.api import (
    EvalBatchRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LogProbsRequest,
    LogProbsResult,
    OptimStepRequest,
    StepResult,
    TrainBatchRequest,
)
from trainctl.api.operations import Operation, OperationKind, OperationStatus
from trainctl.workers.control.group import LocalGroup
from trainctl.workers.control.op_queue import Handle, Runs, T
from trainctl.workers.control.steps import ModelState, Steps
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.rank.join import process_group_backend
from trainctl.workers.rank.worker import RankWorker


async def _no_hook(_h: Handle, _adapter: str | None) -> list[str]:
    """The service checkpoints and syncs samplers after a step; in-process, nothing happens."""
    return []


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
        store=HashStore(),
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
        self.worker.build(cfg)
        self.cfg: EngineConfig = self.worker.shard.cfg
        self.state = ModelState()
        self.steps = Steps(LocalGroup(self.worker), self.state, after_train=_no_hook)

    @property
    def engine(self) -> Any:
        """The ``EngineShard`` (its model chunks, optimizer and profiler)."""
        return self.worker.shard

    @property
    def step(self) -> int:
        """Optimizer steps applied."""
        return self.state.step

    def _run(self, kind: OperationKind, runner: Runs[T]) -> T:
        op = Operation(
            id=f"local-{kind.value}", kind=kind, status=OperationStatus.RUNNING,
            created_at=time.time(),
        )  # fmt: skip
        handle = Handle(op=op, run=None, key=None, fingerprint="")

        async def run() -> T:
            return await runner(handle)

        return asyncio.run(run())

    def train_batch(self, req: TrainBatchRequest) -> StepResult:
        """Forward/backward and the optimizer step; a non-finite gradient norm applies
        nothing (as in the service)."""
        return self._run(OperationKind.TRAIN_BATCH, self.steps.train(req))

    def eval_batch(self, req: EvalBatchRequest) -> StepResult:
        return self._run(OperationKind.EVAL_BATCH, self.steps.eval(req))

    def logprobs(self, req: LogProbsRequest) -> LogProbsResult:
        return self._run(OperationKind.LOGPROBS, self.steps.logprobs(req))

    def forward_backward(self, req: ForwardBackwardRequest) -> ForwardBackwardResult:
        """A split-step part: gradients wait for ``optim_step``."""
        kind = OperationKind.FORWARD_BACKWARD
        return self._run(kind, self.steps.forward_backward(req))

    def optim_step(self, req: OptimStepRequest) -> StepResult:
        return self._run(OperationKind.OPTIM_STEP, self.steps.optim_step(req))

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
        self.worker.release()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
