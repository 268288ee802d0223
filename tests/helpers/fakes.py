"""An in-memory stand-in for the controller, for route and SDK tests (fast tier only).

It runs the real ``OperationQueue`` (queueing, idempotency, 429) around fake work, so the
HTTP semantics of operations are tested here without Ray.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from trainctl.api import (
    AdapterList,
    ConflictError,
    EvalBatchRequest,
    Info,
    InvalidRequestError,
    LogProbsRequest,
    LogProbsResult,
    MemoryProfileList,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    ModelLimits,
    NotFoundError,
    OperationKind,
    ProfileFile,
    Served,
    StepResult,
    TrainBatchRequest,
)
from trainctl.workers.control.op_queue import Handle, OperationQueue, Operations


class FakeController:
    def __init__(self, vocab_size: int = 100, max_seq_len: int = 16, max_queued: int = 64) -> None:
        self.limits = ModelLimits(vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.calls: list[str] = []
        self.requests: list[Any] = []  # what reached the controller, as the gateway sent it
        self.step = 0
        self.profiling = False
        self.ready = True
        self.delay_s = 0.0
        self.queue = OperationQueue(max_queued=max_queued)
        self.operations = Operations(self.queue, self._prepare, lambda: None)
        self.submit, self.run, self.operation = (
            self.operations.submit, self.operations.run, self.operations.operation,
        )  # fmt: skip
        self.files: dict[str, bytes] = {}
        self.clock_ahead_s = 0.0
        """How far this controller's clock runs ahead of the gateway's (the timeline)."""
        self.remote_spans: list[Any] = []
        self.remote_dropped = 0
        self.timeline_asked: tuple[float, float] | None = None
        self.file_name = "snapshot_rank00_p0d0c0t0.trace.json"
        """The name the profile lists its file under (a hostile server may pick any)."""

    # -- operations ------------------------------------------------------------------------

    async def _prepare(self, kind: str, req: Any) -> Any:
        work = {
            OperationKind.TRAIN_BATCH: self._train,
            OperationKind.EVAL_BATCH: self._eval,
            OperationKind.LOGPROBS: self._logprobs,
            OperationKind.START_MEMORY_PROFILE: self._start,
            OperationKind.STOP_MEMORY_PROFILE: self._stop,
        }
        if kind not in work:
            raise InvalidRequestError(f"no operation {kind!r}")

        async def run(h: Handle) -> Any:
            h.set_phase("working")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return work[kind](req)

        return run

    def _result(self, req: TrainBatchRequest | EvalBatchRequest) -> StepResult:
        n = sum(len(s.tokens) for s in req.sequences)
        return StepResult(
            loss=1.0 / (1 + self.step),
            step=self.step,
            metrics={"tokens:sum": float(n)},
            timings={"total_s": 0.0},
        )

    def _train(self, req: TrainBatchRequest) -> StepResult:
        self.calls.append("train_batch")
        self.requests.append(req)
        req.check_expected_step(self.step)  # the controller's own rule, not a copy
        self.step += 1
        return self._result(req)

    def _eval(self, req: EvalBatchRequest) -> StepResult:
        self.calls.append("eval_batch")
        self.requests.append(req)
        return self._result(req)

    def _logprobs(self, req: LogProbsRequest) -> LogProbsResult:
        self.calls.append("logprobs")
        rows = [[0.0] + [-float(t) / 100 for t in s.tokens[1:]] for s in req.sequences]
        return LogProbsResult(
            step=self.step,
            logprobs=rows,
            entropy=[[1.0] * len(r) for r in rows] if req.entropy else None,
        )

    def _start(self, req: MemoryProfileStartRequest) -> MemoryProfileStarted:
        self.calls.append(f"start_memory_profile({req.max_entries})")
        if self.profiling:
            raise ConflictError("memory profile p1 is already recording")
        self.profiling = True
        return MemoryProfileStarted(profile_id="p1", ranks=1)

    def _stop(self, _: Any) -> MemoryProfileResult:
        self.calls.append("stop_memory_profile")
        if not self.profiling:
            raise ConflictError("no memory profile is recording; start one first")
        self.profiling = False
        self.files = {
            self.file_name: b'{"traceEvents": []}',
            "snapshot_rank00_p0d0c0t0.png": b"\x89PNG",
        }
        return self._profile()

    def _profile(self) -> MemoryProfileResult:
        return MemoryProfileResult(
            profile_id="p1",
            files=[
                ProfileFile(
                    name=self.file_name,
                    rank=0,
                    coords={"dp": 0, "cp": 0, "tp": 0, "pp": 0},
                    size_bytes=19,
                    picture="snapshot_rank00_p0d0c0t0.png",
                )
            ],
        )

    # -- reads -------------------------------------------------------------------------------

    async def list_profiles(self) -> MemoryProfileList:
        return MemoryProfileList(profiles=[self._profile()] if self.files else [])

    async def get_profile(self, profile_id: str) -> MemoryProfileResult:
        if profile_id != "p1" or not self.files:
            raise NotFoundError(f"memory profile {profile_id!r} does not exist")
        return self._profile()

    async def read_profile_file(self, profile_id: str, name: str) -> bytes:
        if profile_id != "p1" or name not in self.files:
            raise NotFoundError(f"memory profile {profile_id!r} has no file {name!r}")
        return self.files[name]

    async def metrics_text(self) -> bytes:
        return f"trainctl_steps_total {self.step}.0\n".encode()

    async def info(self) -> Info:
        return Info(
            model={"vocab_size": self.limits.vocab_size},
            layout={"dp": 1},
            engine={},
            world_size=1,
            step=self.step,
            weights_digest="0" * 64,
            ranks=[],
            versions={},
            limits=self.limits,
        )

    async def served(self) -> Served:
        return Served(model_name=(await self.info()).model_name)

    async def is_ready(self) -> bool:
        return self.ready

    async def sampler_statuses(self) -> dict[str, int] | None:
        return None

    async def model_limits(self) -> ModelLimits:
        return self.limits

    async def clock(self) -> float:
        return time.time() + self.clock_ahead_s

    async def timeline(self, since: float, until: float) -> tuple[list[Any], int]:
        """The spans a remote controller would answer: ``remote_spans`` in the range asked."""
        self.timeline_asked = (since, until)
        kept = [s for s in self.remote_spans if s.end_s >= since and s.start_s <= until]
        return kept, self.remote_dropped

    async def list_adapters(self) -> AdapterList:
        return AdapterList(adapters=[], max_adapters=0, max_rank=64)
