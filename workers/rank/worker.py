"""The rank actor: one Ray actor per global rank, hosting that rank's ``EngineShard``.

The controller creates the actors in a placement group, asks rank 0 for a rendezvous address,
initialises ``torch.distributed`` on all of them (``join.py``; every group with a timeout, so
a dead peer becomes an error instead of a hang), then builds the engines. Each method is what
the controller calls through Ray (``RankGroup.call``); the work is its collaborators':
the shard's (steps), ``RankCheckpoints``, ``Exporter``, ``WeightStreamer``, ``GroupJoin``
and ``Faults``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.api import CheckpointInfo
from trainctl.workers import spans
from trainctl.workers.engine.boundary import (
    AdapterInfo,
    AdapterSpec,
    Applied,
    LogProbsPart,
    OpRef,
    OwnedShards,
    PartResult,
    PeerStep,
    RankMeta,
    RankProfile,
    StepReport,
    WrittenFile,
)
from trainctl.workers.engine.config import EngineConfig, OptimizerConfig
from trainctl.workers.rank import logs
from trainctl.workers.rank.checkpoints import RankCheckpoints
from trainctl.workers.rank.export import Exporter, Part
from trainctl.workers.rank.faults import Faults
from trainctl.workers.rank.join import GroupJoin
from trainctl.workers.rank.logs import current_operation
from trainctl.workers.rank.step_plan import StepPlan
from trainctl.workers.rank.stream import WeightStreamer
from trainctl.workers.sampler.spec import PeftAdapter
from trainctl.workers.sampler.stream import Piece, Sent, StreamPlan

if TYPE_CHECKING:
    from trainctl.workers.engine.shard import EngineShard


def quiet_megatron() -> None:
    """megatron-core logs every parameter name and warns about absent CUDA extensions."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*cuda_graph_scope.*", ".*TE.*"):
        warnings.filterwarnings("ignore", message=pattern)


NO_OP = OpRef()
"""A call outside any operation (a test, a drill)."""


@contextlib.contextmanager
def _operation(op: OpRef, name: str) -> Iterator[None]:
    """The block as operation ``op``'s work on this rank: its log lines carry the id, and it
    is one span named ``name`` on this rank's row of the timeline, in the operation's trace."""
    token = current_operation.set(op.id)
    try:
        with spans.span(name, parent=op.traceparent, op=op.id):
            yield
    finally:
        current_operation.reset(token)


@dataclass
class _Built:
    """What ``build`` makes: the engine shard and the collaborators that work on it."""

    engine: EngineShard
    exporter: Exporter
    streamer: WeightStreamer
    checkpoints: RankCheckpoints


class RankWorker:
    """One rank. Owns its membership of the process group (``join``), its injected faults
    (``faults``) and, once built, its ``EngineShard`` with the rank's side of checkpoints,
    exports and weight syncs. Plain class; ``workers.control`` wraps it with ``ray.remote``."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        import torch

        logs.configure()
        quiet_megatron()
        torch.set_num_threads(num_threads)
        self.rank = rank
        self.world_size = world_size
        self.join = GroupJoin(rank, world_size)
        self.faults = Faults(rank)
        self._built: _Built | None = None
        spans.install_from_env(f"rank {rank}")

    @property
    def built(self) -> _Built:
        if self._built is None:
            raise RuntimeError(f"rank {self.rank} has no engine yet: build it first")
        return self._built

    @property
    def shard(self) -> EngineShard:
        """This rank's engine shard (``build`` makes it)."""
        return self.built.engine

    # -- the process group (join.py) ------------------------------------------------------------

    def rendezvous_address(self, timeout_s: float) -> tuple[str, int, str]:
        return self.join.rendezvous_address(timeout_s)

    def init_process_group(
        self, host: str, port: int, secret: str, backend: str, timeout_s: float
    ) -> None:
        self.join.init_process_group(host, port, secret, backend, timeout_s)

    def shutdown(self) -> None:
        self.join.close()

    def build(self, cfg: EngineConfig) -> RankMeta:
        from trainctl.workers.engine.shard import EngineShard

        engine = EngineShard(cfg)
        self._built = _Built(
            engine=engine,
            exporter=Exporter(engine),
            streamer=WeightStreamer(engine),
            checkpoints=RankCheckpoints(engine, self.rank, self.world_size),
        )
        return RankMeta(
            coords=engine.coords,
            parameters=engine.num_parameters(),
            pid=os.getpid(),
            node=_node_address(),
        )

    def release(self) -> None:
        """Free the model and the optimizer; the process group stays, for the next build."""
        self.shard.close()
        self._built = None

    # -- steps (the shard's) -------------------------------------------------------------------

    def _shard(self, plan: StepPlan) -> Any:
        self.faults.check("forward")
        self.shard.profiler.pause_if_expired()  # a CPU profile's recording is capped
        self.shard.adapters.activate(plan.adapter)
        return plan.microbatches[self.shard.coords.dp]

    def accumulate(self, plan: StepPlan, op: OpRef = NO_OP) -> StepReport:
        """Phase 1 of a train step: forward/backward; gradients held until ``apply``."""
        with _operation(op, "accumulate"):
            report = self.shard.accumulate(self._shard(plan), plan.loss)
            self.faults.point("accumulate_end", undo=self.shard.optim.zero_grad)
            return report

    def apply(self, op: OpRef = NO_OP, hyper: OptimizerConfig | None = None) -> Applied:
        """Phase 2, once every rank finished phase 1: the optimizer update (local), with
        ``hyper`` (``optim_step``'s AdamW settings) or the engine config's."""
        with _operation(op, "apply"):
            self.faults.check("optimizer")
            applied = self.shard.apply(hyper)
            self.faults.check("optimizer_end")  # updated here, not yet answered or published
            return applied

    def forward_backward(
        self, plan: StepPlan, op: OpRef = NO_OP, backward: bool = True
    ) -> PartResult:
        """A split-step part: gradients added to the window (not reduced), its report and
        per-sequence log-probs and token losses. On failure here the window is as before the
        call. Without ``backward``: the same outputs, no gradients."""
        with _operation(op, "forward_backward"):
            out = self.shard.forward_backward(self._shard(plan), plan.loss, backward=backward)
            if backward:
                self.faults.point("forward_backward_end", undo=self.shard.rollback_part)
            return out

    def rollback_part(self) -> None:
        """Undo this rank's last part (another rank failed it)."""
        self.shard.rollback_part()

    def finish_window(self, divisor: float, op: OpRef = NO_OP, adapter: str | None = None) -> float:
        """``optim_step`` phase 1: the window's one reduction, then the grad norm (of
        ``adapter``'s window, with adapters)."""
        with _operation(op, "finish_window"):
            self.faults.check("finish_window")
            self.shard.adapters.activate(adapter)
            return float(self.shard.finish_window(divisor))

    def publish(self, op: OpRef = NO_OP) -> float:
        """Phase 3 under ZeRO-1, once every rank's update succeeded: the all-gather of the
        updated parameters; its seconds."""
        with _operation(op, "publish"):
            t0 = time.perf_counter()
            self.faults.check("publish")
            self.shard.optim.publish()
            return time.perf_counter() - t0

    def discard(self) -> None:
        """Drop the accumulated gradients (another rank failed phase 1)."""
        self.shard.optim.zero_grad()

    def eval_batch(self, plan: StepPlan, op: OpRef = NO_OP) -> StepReport:
        with _operation(op, "eval_batch"):
            return self.shard.eval_batch(self._shard(plan), plan.loss)

    def logprobs(
        self, plan: StepPlan, entropy: bool, routes: bool = False, op: OpRef = NO_OP
    ) -> LogProbsPart:
        with _operation(op, "logprobs"):
            return self.shard.logprobs(self._shard(plan), entropy=entropy, routes=routes)

    def weights_digest(self) -> str:
        return str(self.shard.weights_digest())

    def start_memory_profile(self, max_entries: int) -> None:
        self.shard.profiler.start(max_entries)

    def stop_memory_profile(self) -> RankProfile:
        """Stop recording; this rank's file, as bytes (the controller stores it)."""
        with tempfile.TemporaryDirectory(prefix="trainctl-profile-") as tmp:
            path = self.shard.profiler.stop(Path(tmp))
            data = path.read_bytes()
        return RankProfile(name=path.name, coords=self.shard.coords, data=data)

    # -- checkpoints (checkpoints.py) -----------------------------------------------------------

    def save_checkpoint(
        self,
        directory: str,
        adapter: str | None = None,
        reshardable: bool = False,
        header: dict[str, Any] | None = None,
    ) -> WrittenFile:
        return self.built.checkpoints.save(directory, adapter, reshardable, header or {})

    def start_checkpoint(
        self,
        directory: str,
        adapter: str | None = None,
        reshardable: bool = False,
        header: dict[str, Any] | None = None,
    ) -> float:
        return self.built.checkpoints.start(directory, adapter, reshardable, header or {})

    def checkpoint_written(self) -> WrittenFile | None:
        return self.built.checkpoints.written()

    def stage_checkpoint(
        self,
        directory: str,
        info: CheckpointInfo,
        adapter: str | None = None,
        into: str | None = None,
        optimizer: bool = True,
    ) -> None:
        self.built.checkpoints.stage(directory, info, adapter, into, optimizer)

    def apply_checkpoint(self, optimizer: bool = True) -> int:
        return self.built.checkpoints.apply(optimizer)

    def drop_staged(self) -> None:
        self.built.checkpoints.drop_staged()

    # -- recovery from live peers (workers/control/peers.py) -----------------------------------

    def peer_step(self) -> PeerStep:
        """A survivor of a lost group: drop the gradients of the step that failed (its
        collectives cannot finish) and say which steps this rank's state is at."""
        self.discard()
        return PeerStep(
            step=int(self.shard.step),
            adapters={i.spec.name: i.step for i in self.shard.adapters.infos()},
        )

    def peer_state(self) -> tuple[int, dict[str, Any]]:
        return self.built.checkpoints.peer_state()

    def stage_peers(self, *states: dict[str, Any]) -> None:
        self.built.checkpoints.stage_peers(list(states))

    # -- adapters (workers/engine/adapter_bank.py) -----------------------------------------------

    def create_adapter(self, spec: AdapterSpec) -> None:
        self.shard.adapters.create(spec)

    def delete_adapter(self, name: str) -> None:
        self.shard.adapters.delete(name)

    def adapter_infos(self) -> list[AdapterInfo]:
        return self.shard.adapters.infos()

    def adapter_digest(self, name: str) -> str:
        """sha256 of adapter ``name``'s tensors on this rank."""
        return self.shard.adapters.digest(name)

    # -- the timeline (workers/spans.py) --------------------------------------------------------

    def clock(self) -> float:
        return spans.now()

    def recent_spans(
        self, since: float, until: float, offset_s: float
    ) -> tuple[list[spans.SpanRecord], int]:
        """This rank's spans overlapping ``[since, until]`` of the collector's clock, which
        runs ``offset_s`` ahead of this rank's (``spans.clock_offset``), on that clock; and
        the count its ring dropped."""
        return spans.recent(since, until, offset_s)

    # -- fault injection (faults.py; through Ray only, never on the HTTP API) ------------------

    def inject_fault(self, phase: str, times: int = 1, kill: bool = False) -> None:
        self.faults.arm(phase, times, kill)

    # -- exports (export.py) ---------------------------------------------------------------------

    def canonical_shards(self, part: Part = "base", adapter: str | None = None) -> OwnedShards:
        return self.built.exporter.canonical_shards(part, adapter)

    def write_hf(
        self, parts: list[Any], directory: str, adapter: str | None = None, merged: bool = False
    ) -> list[WrittenFile]:
        return self.built.exporter.write_hf(parts, directory, adapter, merged)

    def peft_weights(self, parts: list[Any], adapter: str) -> tuple[PeftAdapter, int]:
        return self.built.exporter.peft_weights(parts, adapter)

    def hf_config(self) -> dict[str, Any]:
        return self.built.exporter.hf_config()

    # -- streamed weight syncs (stream.py) -------------------------------------------------------

    def stream_pieces(self) -> list[Piece]:
        return self.built.streamer.pieces()

    def stream_to_object_store(
        self, plan: StreamPlan, trace: str | None = None
    ) -> tuple[list[Any], Sent]:
        """This owner's buckets into the object store; one span (``export``) in the sync's
        trace (``trace``)."""
        with spans.span("export", parent=trace, transport="object_store"):
            return self.built.streamer.to_object_store(plan)

    def open_collective(
        self,
        plan: StreamPlan,
        receivers: int,
        generation: int,
        timeout_s: float,
        rv: dict[str, Any] | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 0,
    ) -> dict[str, Any]:
        return self.built.streamer.open_collective(
            plan, receivers, generation, timeout_s, _node_ip(), rv, backend, bucket_bytes
        )

    def send_collective(self, trace: str | None = None) -> Sent:
        """Send this owner's staged buckets (an armed ``broadcast_stall``: rank 0 stops after
        its first); one span (``export``) in the sync's trace (``trace``)."""
        with spans.span("export", parent=trace, transport="collective"):
            return self.built.streamer.send(self.faults.stall())


def _node_ip() -> str:
    """The address the sampler engines reach this process at (loopback outside Ray)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address())


def _node_address() -> str:
    """This rank's node: its address and Ray node id (two simulated nodes share an address);
    outside Ray (the in-process engine), the host's name."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        import socket

        return socket.gethostname()
    ctx = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()}/{ctx.get_node_id()[:12]}"
