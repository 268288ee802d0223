"""A stand-in for the controller's ``RankGroup`` (fast tier only): the real ``Controller``
(queue, steps, checkpoints, recovery) runs around ranks that hold one number, their
"weights version", so the controller's own bookkeeping is tested without Ray or torch."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainctl.api import WorkerError
from trainctl.workers.engine.boundary import (
    Applied,
    PeerStep,
    RankCoords,
    RankMeta,
    WrittenFile,
)
from trainctl.workers.engine.config import ConfigError, EngineConfig


class FakeRankGroup:
    def __init__(self, world_size: int = 2, *, replicated_optimizer: bool = False) -> None:
        self.world_size = world_size
        self.cfg = EngineConfig.from_dict(
            {"layout": {"dp": world_size},
             "distributed_optimizer": "off" if replicated_optimizer else "auto"}
        )  # fmt: skip
        """As the real group's: at dp > 1 ZeRO-1 is on unless ``replicated_optimizer``, so
        recovery from peers falls back to the checkpoint unless asked."""
        self.dead: set[int] = set()
        """Ranks that give no answer to a survey (``answers``)."""
        self.writing: dict[int, tuple[Path, int]] = {}
        """A background save per rank: its file and the version copied when it started."""
        self.polls: dict[int, int] = {}
        self.write_polls = 0
        """Polls a background write answers "not yet" before it is written."""
        self.write_error: BaseException | None = None
        """What a background write fails with (a full disk)."""
        self.shrunk = False
        """The ranks run fewer DP replicas than configured (``place(shrink=True)``)."""
        self.room = True
        """Whether the live nodes hold the configured layout (a test takes a node away)."""
        self.place_errors: list[BaseException] = []
        """Raised by the next calls of ``place`` (the cluster has no room), one per call."""
        self.version = 0
        """What the ranks hold: +1 per applied step; saved and loaded by checkpoints."""
        self.calls: list[str] = []
        self.fail: dict[str, list[BaseException]] = {}
        """Method name -> errors raised by its next calls, one per call."""
        self.ranks: list[Any] = []
        self.meta: list[RankMeta] = []
        self.staged = 0

    @property
    def configured(self) -> EngineConfig:
        return self.cfg

    def holds_configured(self) -> bool:
        return self.room

    async def place(self, *, shrink: bool = False) -> None:
        if self.place_errors:
            raise self.place_errors.pop(0)
        if not self.room and not shrink:
            raise ConfigError("the live nodes give too few slots")
        self.shrunk = not self.room

    async def spawn(self) -> None:
        self.calls.append("spawn")
        self.version = 0
        self.ranks = [object()] * self.world_size
        self.meta = [
            RankMeta(
                coords=RankCoords(rank=r, dp=r, cp=0, tp=0, pp=0), parameters=10, pid=0, node=""
            )
            for r in range(self.world_size)
        ]

    def kill(self, *, release: bool = False) -> None:
        self.calls.append("kill")
        self.ranks = []

    async def call(self, method: Any, *args: Any) -> list[Any]:
        name = method.__name__
        self.calls.append(name)
        if self.fail.get(name):
            raise self.fail[name].pop(0)
        out = []
        for rank in range(self.world_size):
            try:
                out.append(self._one(name, rank, *args))
            except Exception as e:  # as the real group reports a rank's exception
                raise WorkerError(f"rank {rank} failed in {name}: {type(e).__name__}: {e}") from e
        return out

    def _one(self, name: str, rank: int, *args: Any) -> Any:
        if name == "finish_window":
            return 1.0
        if name == "apply":
            if rank == 0:
                self.version += 1
            return Applied(grad_norm=1.0, seconds=0.01)
        if name == "publish":  # ZeRO-1's all-gather of the updated shards: its seconds
            return 0.01
        if name == "save_checkpoint":
            path = Path(args[0]) / f"rank-{rank:05d}.pt"
            path.write_text(str(self.version))
            return WrittenFile(name=path.name, size_bytes=path.stat().st_size)
        if name == "start_checkpoint":  # copied now, "written" after ``write_polls`` polls
            self.writing[rank] = (Path(args[0]) / f"rank-{rank:05d}.pt", self.version)
            self.polls[rank] = self.write_polls
            return 0.01
        if name == "checkpoint_written":
            if self.polls.get(rank, 0) > 0:
                self.polls[rank] -= 1
                return None
            if self.write_error is not None:
                raise self.write_error
            path, version = self.writing[rank]
            path.write_text(str(version))
            return WrittenFile(name=path.name, size_bytes=path.stat().st_size)
        if name == "load_checkpoint":  # one phase: each rank reads and applies its shard
            if rank == 0:
                self.version = int((Path(args[0]) / f"rank-{rank:05d}.pt").read_text())
            return int((Path(args[0]) / f"rank-{rank:05d}.pt").read_text())
        if name == "stage_checkpoint":
            self.staged = int((Path(args[0]) / f"rank-{rank:05d}.pt").read_text())
            return None
        if name == "apply_checkpoint":
            if rank == 0:
                self.version = self.staged
            return self.staged
        if name == "stage_peers":  # the survivors' copies: each one its version
            self.staged = int(args[0])
            return None
        if name == "weights_digest":
            return hashlib.sha256(f"{rank}:{self.version}".encode()).hexdigest()
        return None

    def put(self, value: Any) -> Any:
        return value

    async def answers(self, method: Any, *, timeout_s: float) -> dict[int, Any]:
        self.calls.append(method.__name__)
        alive = [r for r in range(self.world_size) if r not in self.dead]
        return {r: PeerStep(step=self.version, adapters={}) for r in alive}

    async def keep(self, ranks: list[int], method: Any, *, timeout_s: float) -> Any:
        self.calls.append(method.__name__)
        return [self.version] * len(ranks), [self.version] * len(ranks)

    async def call_quietly(self, method: Any) -> None:
        self.calls.append(method.__name__)

    def digest_of(self, digests: list[str]) -> str:
        return hashlib.sha256("".join(digests).encode()).hexdigest()

    async def digests(self) -> list[str]:
        from trainctl.workers.rank.worker import RankWorker

        return await self.call(RankWorker.weights_digest)

    def parameters_per_replica(self) -> int:
        return 10


def controller(
    data: Path, world_size: int = 2, *, replicated_optimizer: bool = False, **kwargs: Any
) -> tuple[Any, FakeRankGroup]:
    """A real ``Controller`` over a ``FakeRankGroup``; call ``await c.start()`` first."""
    from trainctl.workers.control.controller import Controller, ControllerOptions

    fake = FakeRankGroup(world_size, replicated_optimizer=replicated_optimizer)
    options = ControllerOptions(data_root=str(data), rank_num_cpus=1, **kwargs)
    c = Controller(EngineConfig(), options, group=fake)  # type: ignore[arg-type]
    return c, fake
