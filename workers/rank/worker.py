"""The rank actor: one Ray actor per global rank, hosting that rank's ``EngineShard``.

The controller creates the actors in a placement group, asks rank 0 for a rendezvous address,
initialises ``torch.distributed`` on all of them (``process_group_backend``; every group with
a timeout, so a dead peer becomes an error instead of a hang), then builds the engines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.api import CheckpointInfo, TrainctlError
from trainctl.workers.engine.boundary import (
    AdapterInfo,
    AdapterSpec,
    Applied,
    LogProbsPart,
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
from trainctl.workers.rank.background_save import BackgroundSave
from trainctl.workers.rank.export import Exporter, Part
from trainctl.workers.rank.logs import current_operation
from trainctl.workers.rank.step_plan import StepPlan
from trainctl.workers.rank.stream import WeightStreamer
from trainctl.workers.sampler.spec import PeftAdapter
from trainctl.workers.sampler.stream import Piece, Sent, StreamPlan

if TYPE_CHECKING:
    from trainctl.workers.engine.shard import EngineShard

log = logging.getLogger(__name__)


def process_group_backend(backend: str, *, cuda: bool) -> str:
    """``auto``: gloo on CPU; with CUDA, NCCL for device tensors and gloo for host ones (the
    step's bookkeeping - packing metadata, loss and metric scalars - stays on the host)."""
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def quiet_megatron() -> None:
    """megatron-core logs every parameter name and warns about absent CUDA extensions."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*cuda_graph_scope.*", ".*TE.*"):
        warnings.filterwarnings("ignore", message=pattern)


FAULT_PHASES = (
    "forward",
    "accumulate_end",
    "forward_backward_end",
    "finish_window",
    "optimizer",
    "optimizer_end",
    "publish",
    "broadcast_stall",
)
BROADCAST_STALL_S = 10.0
"""How long rank 0 stops after the first bucket of a broadcast told to stall (a drill: an
engine lost, or hung, while the others wait mid-broadcast)."""


class InjectedFault(RuntimeError):
    """Raised by a rank told to fail (``inject_fault``)."""


@contextlib.contextmanager
def _operation(op_id: str) -> Iterator[None]:
    token = current_operation.set(op_id)
    try:
        yield
    finally:
        current_operation.reset(token)


class RankWorker:
    """One rank: its process group, its ``EngineShard`` (``engine``) and the rank's side of
    checkpoints and exports (``exporter``). Its methods are what the controller calls through
    Ray; each delegates to the collaborator that owns the work. Plain class;
    ``workers.controller`` wraps it with ``ray.remote``."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        import torch

        logs.configure()
        quiet_megatron()
        torch.set_num_threads(num_threads)
        self.rank = rank
        self.world_size = world_size
        self.engine: EngineShard | None = None
        self.exporter: Exporter | None = None
        self._faults: dict[str, int] = {}
        self._kills: set[str] = set()
        """Phases whose injected fault kills the process (``inject_fault(kill=True)``)."""
        self._store: Any = None
        self._gate: Any = None
        """Rank 0: the gate in front of the rendezvous store (``rendezvous_address``)."""
        self._door: Any = None
        """Every other rank: its way to rank 0's gate."""
        self._staged: tuple[str, Any] | None = None
        """A checkpoint shard read by ``stage_checkpoint`` (and the adapter to load from it,
        and as what), waiting for ``apply_checkpoint``."""
        self.streamer: WeightStreamer | None = None
        """This rank's side of the samplers' weight syncs."""
        self.saving = BackgroundSave()
        """This rank's checkpoint write in the background (``start_checkpoint``)."""

    @property
    def shard(self) -> EngineShard:
        """This rank's engine shard (``build`` makes it)."""
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} has no engine yet: build it first")
        return self.engine

    def rendezvous_address(self, timeout_s: float) -> tuple[str, int, str]:
        """Called on rank 0: start the group's rendezvous store and return where the other
        ranks reach it, and the group's secret (which travels over Ray only).

        torch's store takes ``set`` and ``delete`` from anyone who reaches it. So it listens
        on loopback alone, behind a gate on the node's cluster address (a port the OS picks:
        no race for a 'free' port) that admits a connection only once it has shown the
        secret (``workers/rendezvous.py``); the others go through a door of their own. And
        every key the group uses is under a prefix made of the secret as well
        (``init_process_group``)."""
        import secrets
        import socket

        import ray

        from trainctl.workers import rendezvous

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray
        host = node_ip()
        secret = secrets.token_hex(16)
        self._store = rendezvous.master_store(self.world_size, timeout_s)
        self._gate = rendezvous.Gate(socket.create_server((host, 0), backlog=128), secret)
        self._gate.open(int(self._store.port))
        return host, self._gate.port, secret

    def init_process_group(
        self, host: str, port: int, secret: str, backend: str, timeout_s: float
    ) -> None:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore

        from trainctl.workers import rendezvous

        backend = process_group_backend(backend, cuda=torch.cuda.is_available())
        store = self._store
        if store is None:  # through a door to rank 0's gate
            store, self._door = rendezvous.member_store(
                host, port, secret, self.world_size, timeout_s
            )
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=PrefixStore(f"trainctl-{secret}", store),  # keys no one else can name
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    def build(self, cfg: EngineConfig) -> RankMeta:
        from trainctl.workers.engine.shard import EngineShard

        self.engine = EngineShard(cfg)
        self.exporter = Exporter(self.engine)
        self.streamer = WeightStreamer(self.engine)
        return RankMeta(
            coords=self.engine.coords,
            parameters=self.engine.num_parameters(),
            pid=os.getpid(),
            node=_node_address(),
        )

    def _shard(self, plan: StepPlan) -> Any:
        self._check_fault("forward")
        self.shard.profiler.pause_if_expired()  # a CPU profile's recording is capped
        self.shard.adapters.activate(plan.adapter)
        return plan.microbatches[self.shard.coords.dp]

    def accumulate(self, plan: StepPlan, op_id: str = "-") -> StepReport:
        """Phase 1 of a train step: forward/backward; gradients held until ``apply``."""
        with _operation(op_id):
            report = self.shard.accumulate(self._shard(plan), plan.loss)
            self._fault_point("accumulate_end", undo=self.shard.optim.zero_grad)
            return report

    def _fault_point(self, phase: str, *, undo: Callable[[], None]) -> None:
        """An injected fault at the end of ``phase``, after ``undo`` took back its work."""
        try:
            self._check_fault(phase)
        except InjectedFault:
            undo()
            raise

    def apply(self, op_id: str = "-", hyper: OptimizerConfig | None = None) -> Applied:
        """Phase 2, once every rank finished phase 1: the optimizer update (local), with
        ``hyper`` (``optim_step``'s AdamW settings) or the engine config's."""
        with _operation(op_id):
            self._check_fault("optimizer")
            applied = self.shard.apply(hyper)
            self._check_fault("optimizer_end")  # updated here, not yet answered or published
            return applied

    def forward_backward(
        self, plan: StepPlan, op_id: str = "-", backward: bool = True
    ) -> PartResult:
        """A split-step part: gradients added to the window (not reduced), its report and
        per-sequence log-probs and token losses. On failure here the window is as before the
        call. Without ``backward``: the same outputs, no gradients."""
        with _operation(op_id):
            out = self.shard.forward_backward(self._shard(plan), plan.loss, backward=backward)
            if backward:
                self._fault_point("forward_backward_end", undo=self.shard.rollback_part)
            return out

    def rollback_part(self) -> None:
        """Undo this rank's last part (another rank failed it)."""
        self.shard.rollback_part()

    def finish_window(self, divisor: float, op_id: str = "-", adapter: str | None = None) -> float:
        """``optim_step`` phase 1: the window's one reduction, then the grad norm (of
        ``adapter``'s window, with adapters)."""
        with _operation(op_id):
            self._check_fault("finish_window")
            self.shard.adapters.activate(adapter)
            return float(self.shard.finish_window(divisor))

    def publish(self, op_id: str = "-") -> float:
        """Phase 3 under ZeRO-1, once every rank's update succeeded: the all-gather of the
        updated parameters; its seconds."""
        with _operation(op_id):
            t0 = time.perf_counter()
            self._check_fault("publish")
            self.shard.optim.publish()
            return time.perf_counter() - t0

    def discard(self) -> None:
        """Drop the accumulated gradients (another rank failed phase 1)."""
        self.shard.optim.zero_grad()

    def eval_batch(self, plan: StepPlan, op_id: str = "-") -> StepReport:
        with _operation(op_id):
            return self.shard.eval_batch(self._shard(plan), plan.loss)

    def logprobs(
        self, plan: StepPlan, entropy: bool, routes: bool = False, op_id: str = "-"
    ) -> LogProbsPart:
        with _operation(op_id):
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

    # -- checkpoints and export ----------------------------------------------------------------

    def save_checkpoint(
        self,
        directory: str,
        adapter: str | None = None,
        reshardable: bool = False,
        header: dict[str, Any] | None = None,
    ) -> WrittenFile:
        """Write this rank's shard of the training state (``adapter``: that adapter's alone)
        into ``directory`` (not yet final: the controller renames the directory once every
        rank has written), hashed as it is written, with ``header`` (the save's id, step and
        layout); ``reshardable``: in the format any layout loads
        (``workers/engine/checkpoint/reshard.py``)."""
        from trainctl.workers.engine.checkpoint import files

        ckpt = self.shard.checkpoint
        state = ckpt.reshardable_state(adapter) if reshardable else ckpt.state(adapter)
        return files.write(state, Path(directory), self.rank, header or {})

    def start_checkpoint(
        self,
        directory: str,
        adapter: str | None = None,
        reshardable: bool = False,
        header: dict[str, Any] | None = None,
    ) -> float:
        """``save_checkpoint`` in the background (``--async-save``): copy this rank's state
        and base weights now (the seconds it took: all the step waits for), then write and
        hash the state, and hash the weights (the manifest's digest), in a thread;
        ``checkpoint_written`` says when it is done."""
        from trainctl.workers.engine.checkpoint import files

        t0 = time.perf_counter()
        ckpt = self.shard.checkpoint
        if reshardable:  # pieces are fp32 host copies already
            state = ckpt.reshardable_state(adapter)
        else:  # the live tensors: copied, since training goes on while they are written
            state = files.snapshot(ckpt.state(adapter))
        base = None if adapter is not None else files.snapshot(self.shard.base_parameters())
        self.saving.start(state, Path(directory), self.rank, header or {}, base)
        return time.perf_counter() - t0

    def checkpoint_written(self) -> WrittenFile | None:
        """The file of the background write once done, None while it runs; its error if it
        failed."""
        return self.saving.written()

    def stage_checkpoint(
        self,
        directory: str,
        info: CheckpointInfo,
        adapter: str | None = None,
        into: str | None = None,
        optimizer: bool = True,
    ) -> None:
        """Phase 1 of a load, changing nothing: prove this rank's share of the checkpoint's
        files against its manifest ``info`` (every file is proved by one rank, whatever the
        writer's layout), then read this rank's shard and check it fits (``adapter``: that
        adapter's part, loaded as ``into``). Only tensors and plain containers are unpickled
        (``weights_only``). A reshardable checkpoint: this rank's shard is cut out of every
        rank file, written at any layout. A problem is a ``CheckpointInvalidError`` (409)
        naming the file and why."""
        from trainctl.workers.engine.checkpoint import files

        path, cid = Path(directory), info.checkpoint_id
        files.prove(
            path, info, files.share(path, info, self.rank, self.world_size), optimizer=optimizer
        )
        ckpt = self.shard.checkpoint
        try:
            if info.format == "reshardable":
                staged = ckpt.stage_reshardable(files.reader(path, cid), adapter, into)
                self._staged = ("reshardable", staged)
                return
            state = files.read(path / files.name(self.rank), cid)
            ckpt.check(state, adapter, into)
        except TrainctlError:
            raise
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # it does not fit here
            raise files.invalid(cid, None, str(e)) from None
        self._staged = ("per_rank", (state, adapter, into))

    def apply_checkpoint(self, optimizer: bool = True) -> int:
        """Phase 2 of a load, once every rank staged its shard: local, no collective."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("apply_checkpoint without a staged checkpoint")
        kind, what = staged
        if kind == "reshardable":
            self.shard.checkpoint.apply_reshardable(what, optimizer=optimizer)
        else:
            state, adapter, into = what
            self.shard.checkpoint.load(state, optimizer=optimizer, adapter=adapter, into=into)
        return int(self.shard.step)

    def drop_staged(self) -> None:
        self._staged = None

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
        """A survivor's whole training state in the reshardable format, every piece written as
        if this rank were DP replica 0 (it stands in for the replicas that died); no
        collective. Called with two returns: the step is read, the state stays in the object
        store for the new ranks."""
        return int(self.shard.step), self.shard.checkpoint.reshardable_state(as_replica0=True)

    def stage_peers(self, *states: dict[str, Any]) -> None:
        """Phase 1 of a restore from live peers: this rank's shard cut out of the survivors'
        states (``peer_state``), changing nothing; ``apply_checkpoint`` applies it."""
        from trainctl.workers.engine.checkpoint import reshard

        reader = reshard.Reader.of(list(states), "peers")
        self._staged = ("reshardable", self.shard.checkpoint.stage_reshardable(reader))

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

    # -- fault injection (operators and tests, through Ray only: not on the HTTP API) ---------

    def inject_fault(self, phase: str, times: int = 1, kill: bool = False) -> None:
        """Make the next ``times`` calls of ``phase`` raise: ``forward`` (before any work: the
        peers then block in a collective), ``accumulate_end`` (after phase 1, peers done),
        ``optimizer`` (phase 2, before the update), ``optimizer_end`` (after this rank's
        update, before it answers and before the ZeRO-1 all-gather). ``kill``: the process
        dies there instead (SIGKILL: a crash, nothing cleaned up). ``broadcast_stall``
        raises nothing: rank 0's next ``times`` broadcasts to the samplers stop
        ``BROADCAST_STALL_S`` after their first bucket."""
        if phase not in FAULT_PHASES:
            raise ValueError(f"phase must be one of {FAULT_PHASES}, not {phase!r}")
        self._faults[phase] = times
        self._kills.discard(phase)
        if kill:
            self._kills.add(phase)

    def _check_fault(self, phase: str) -> None:
        if self._faults.get(phase, 0) > 0:
            self._faults[phase] -= 1
            if phase in self._kills:
                log.error("injected crash in %s on rank %d", phase, self.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault in {phase} on rank {self.rank}")

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for relay in (self._gate, self._door):
            if relay is not None:
                relay.close()

    # -- exports (the exporter's) ---------------------------------------------------------------

    def _export(self) -> Exporter:
        if self.exporter is None:
            raise RuntimeError("this rank has no engine yet (build first)")
        return self.exporter

    def canonical_shards(self, part: Part = "base", adapter: str | None = None) -> OwnedShards:
        return self._export().canonical_shards(part, adapter)

    def write_hf(
        self, parts: list[Any], directory: str, adapter: str | None = None, merged: bool = False
    ) -> list[WrittenFile]:
        return self._export().write_hf(parts, directory, adapter, merged)

    # -- streamed weight syncs (the streamer's) -------------------------------------------------

    def _streamer(self) -> WeightStreamer:
        if self.streamer is None:
            raise RuntimeError("this rank has no engine yet (build first)")
        return self.streamer

    def stream_pieces(self) -> list[Piece]:
        return self._streamer().pieces()

    def stream_to_object_store(self, plan: StreamPlan) -> tuple[list[Any], Sent]:
        return self._streamer().to_object_store(plan)

    def open_collective(
        self,
        plan: StreamPlan,
        receivers: int,
        generation: int,
        timeout_s: float,
        rv: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self._streamer().open_collective(
            plan, receivers, generation, timeout_s, _node_ip(), rv
        )

    def send_collective(self) -> Sent:
        """Send this owner's staged buckets (``broadcast_stall``: rank 0 stops
        ``BROADCAST_STALL_S`` after its first)."""
        stall = None
        if self._faults.get("broadcast_stall", 0) > 0:
            self._faults["broadcast_stall"] -= 1

            def stall(i: int) -> None:
                if i == 0:
                    time.sleep(BROADCAST_STALL_S)

        return self._streamer().send(stall)

    def peft_weights(self, parts: list[Any], adapter: str) -> tuple[PeftAdapter, int]:
        return self._export().peft_weights(parts, adapter)

    def hf_config(self) -> dict[str, Any]:
        return self._export().hf_config()


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
