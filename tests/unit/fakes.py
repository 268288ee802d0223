"""An in-memory stand-in for the controller, for route and SDK tests (fast tier only)."""

from __future__ import annotations

from trainctl.api import (
    ConflictError,
    EvalBatchRequest,
    Info,
    MemoryProfileResult,
    MemoryProfileStarted,
    ModelLimits,
    ProfileFile,
    StepResult,
    TrainBatchRequest,
)


class FakeController:
    def __init__(self, vocab_size: int = 100, max_seq_len: int = 16) -> None:
        self.limits = ModelLimits(vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.calls: list[str] = []
        self.step = 0
        self.profiling = False
        self.ready = True

    def _result(self, req: TrainBatchRequest | EvalBatchRequest) -> StepResult:
        n = sum(len(s.tokens) for s in req.sequences)
        return StepResult(
            loss=1.0 / (1 + self.step),
            step=self.step,
            metrics={"tokens:sum": float(n)},
            timings={"total_s": 0.0},
        )

    async def train_batch(self, req: TrainBatchRequest) -> StepResult:
        self.calls.append("train_batch")
        self.step += 1
        return self._result(req)

    async def eval_batch(self, req: EvalBatchRequest) -> StepResult:
        self.calls.append("eval_batch")
        return self._result(req)

    async def start_memory_profile(self, max_entries: int) -> MemoryProfileStarted:
        self.calls.append(f"start_memory_profile({max_entries})")
        if self.profiling:
            raise ConflictError("memory profile p1 is already recording")
        self.profiling = True
        return MemoryProfileStarted(profile_id="p1", ranks=1)

    async def stop_memory_profile(self) -> MemoryProfileResult:
        self.calls.append("stop_memory_profile")
        if not self.profiling:
            raise ConflictError("no memory profile is recording; start one first")
        self.profiling = False
        return MemoryProfileResult(
            profile_id="p1",
            files=[
                ProfileFile(
                    name="snapshot_rank00_p0d0c0t0.trace.json",
                    rank=0,
                    coords={"dp": 0, "cp": 0, "tp": 0, "pp": 0},
                    size_bytes=10,
                )
            ],
        )

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

    async def is_ready(self) -> bool:
        return self.ready

    async def model_limits(self) -> ModelLimits:
        return self.limits
