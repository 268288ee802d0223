"""The collective's ``nccl`` wire for GPU engines (``workers/sampler/wires.py``,
``workers/sampler/relay.py``, ``workers/sampler/vllm_backend/nccl_sender.py``), for its
control flow: no machine that runs these tests has a GPU and vLLM together.

What is real here: the trainers' gloo group the owners relay over (threads, one group), our
sender, and vLLM's own code at both ends of the wire: its packed producer and its
``NCCLWeightTransferEngine`` (parsing our payloads, receiving, unpacking), as our subclass
keeping what it received (``workers/sampler/vllm_backend/nccl_engine.py``) runs it. What is
not: the NCCL communicator (a queue between the two ends), the CUDA streams vLLM's packed code
runs on (none on a CPU), and vLLM's layerwise reload around an update (it needs a real
model)."""

from __future__ import annotations

import contextlib
import queue
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainctl.workers.sampler.relay import Relay
from trainctl.workers.sampler.stream import Piece, StreamPlan
from trainctl.workers.sampler.vllm_backend import nccl_sender
from trainctl.workers.sampler.wires import NcclWire


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(96, 16, generator=g),
        "layers.0.qkv.weight": torch.randn(48, 16, generator=g),
        "layers.0.o.weight": torch.randn(16, 32, generator=g),  # split along columns
        "layers.0.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(96, 16, generator=g),
    }


def _two_owners(weights: dict[str, torch.Tensor]) -> tuple[StreamPlan, dict[int, Any]]:
    """Owners 0 and 1 as TP ranks hold them: halves of rows, halves of columns for the row-
    parallel one, the norm whole on owner 1; small buckets, so that tensors complete after
    several of them."""
    pieces: dict[int, list[Piece]] = {0: [], 1: []}
    values: dict[int, dict[Any, torch.Tensor]] = {0: {}, 1: {}}
    for name, t in weights.items():
        dtype, full = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        if t.dim() == 1:
            parts = {1: (0, 0, t)}
        else:
            dim = 1 if ".o." in name else 0
            cut = t.shape[dim] // 2
            parts = {0: (dim, 0, t.narrow(dim, 0, cut)), 1: (dim, cut, t.narrow(dim, cut, cut))}
        for owner, (dim, start, part) in parts.items():
            p = Piece(name, dim, start, tuple(part.shape), dtype, full, direct=dim == 0)
            pieces[owner].append(p)
            values[owner][p.key] = part.contiguous() if dim == 0 else part
    return StreamPlan.of(pieces, 4_000), values


def _on_ranks(world: int, fn: Any) -> dict[int, Any]:
    """``fn(rank, group)`` on ``world`` threads sharing one gloo group; each one's result
    (an exception raised in one is raised here)."""
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
        try:
            out[rank] = fn(rank, group)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(world):
        if isinstance(out.get(r), Exception):
            raise out[r]
    return out


def test_the_relay_hands_every_tensor_on_whole_in_the_order_the_engines_are_told() -> None:
    weights = _weights()
    plan, values = _two_owners(weights)
    assert len(plan.buckets) > 4 and plan.owners == (0, 1)

    def walk(rank: int, group: Any) -> list[tuple[str, torch.Tensor]]:
        return list(Relay(group, plan, rank, lambda p: values[rank][p.key]))

    got = _on_ranks(2, walk)
    assert got[1] == []  # a non-relay sends and hands nothing on
    update = NcclWire().update_payload(plan, "v1", [])
    assert [n for n, _ in got[0]] == update["names"]
    assert sorted(update["names"]) == sorted(weights)
    for (name, t), dtype, shape in zip(
        got[0], update["dtype_names"], update["shapes"], strict=True
    ):
        assert str(t.dtype) == "torch." + dtype and list(t.shape) == shape, name
        assert torch.equal(t, weights[name]), name


def test_the_nccl_payloads_are_what_vllms_nccl_engine_takes() -> None:
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from trainctl.workers.sampler.vllm_backend.nccl_engine import _engine_class

    plan, _ = _two_owners(_weights())
    rv = {"host": "10.0.0.1", "port": 4321, "world_size": 3, "bucket_bytes": 4_000}
    init = NCCLWeightTransferInitInfo(**NcclWire().init_payload(rv, 2))
    assert (init.master_address, init.master_port) == ("10.0.0.1", 4321)
    assert (init.rank_offset, init.world_size) == (2, 3)  # engine 2 of sender + 2 engines
    assert init.packed and init.packed_buffer_size_bytes == 4_000
    update = _engine_class().update_info_cls(**NcclWire().update_payload(plan, "v1", ["v1"]))
    assert isinstance(update, NCCLWeightTransferUpdateInfo)  # what vLLM's receive reads
    assert len(update.names) == len(set(update.names)) == len(plan.schema)
    assert (update.version, update.keep) == ("v1", ["v1"])


class _Queue:
    """The NCCL communicator's stand-in: what rank 0 broadcasts reaches the engine's
    ``broadcast`` into its buffer, which must be the same size (or the two ends split the
    stream differently)."""

    def __init__(self, side: str, pipe: queue.Queue[torch.Tensor]) -> None:
        self.side, self.pipe, self.destroyed = side, pipe, False

    def broadcast(self, t: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0
        if self.side == "sender":
            self.pipe.put(t.clone())
            return
        sent = self.pipe.get(timeout=30)
        assert sent.numel() == t.numel(), "the engine's buffer differs from the sender's"
        t.copy_(sent)

    def destroy(self) -> None:
        self.destroyed = True


class _Stream:
    def synchronize(self) -> None:
        return None


@pytest.fixture
def no_cuda_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's packed code runs on CUDA streams of the current device; on a CPU, none."""
    from vllm.distributed.weight_transfer import packed_tensor

    monkeypatch.setattr(
        packed_tensor, "_get_streams", lambda i, n: tuple(_Stream() for _ in range(n))
    )
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)


class _Model(torch.nn.Module):
    """What vLLM's engine loads into: every (name, tensor) it is handed, copied."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        for name, t in weights:
            self.loaded[name] = t.clone()


def _vllm_engine(monkeypatch: pytest.MonkeyPatch, comm: _Queue) -> Any:
    """vLLM's own nccl engine as ours keeps what it received, its group our queue (joined as
    its init says), vLLM's layerwise reload around an update counted."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.model_executor.model_loader import reload

    from trainctl.workers.sampler.vllm_backend.nccl_engine import BACKEND, _engine_class

    joined: list[Any] = []
    layerwise: list[str] = []

    def join(info: Any, parallel: Any) -> _Queue:
        joined.append(info)
        return comm

    monkeypatch.setattr(nccl_engine, "worker_init_process_group", join)
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda m: layerwise.append("start"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda m, c: layerwise.append("end"))
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=None)
    engine = _engine_class()(
        WeightTransferConfig(backend=BACKEND), cfg, torch.device("cpu"), _Model()
    )
    engine.joined, engine.layerwise = joined, layerwise
    return engine


@pytest.mark.usefixtures("no_cuda_streams")
def test_rank_zero_broadcasts_what_vllms_nccl_engine_loads_and_reforms_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two owners relay to rank 0, which sends through vLLM's packed producer; vLLM's engine,
    given our payloads, receives the same chunks, loads every tensor exactly and keeps the
    window's versions. The endpoint opens once per generation, and a failed send closes it:
    the next opens a new one."""
    weights = _weights()
    plan, values = _two_owners(weights)
    pipe: queue.Queue[torch.Tensor] = queue.Queue()
    opened: list[Any] = []
    fail = threading.Event()

    def endpoint(rv: Any) -> _Queue:
        opened.append((rv.generation, rv.world_size, rv.backend))
        return _Queue("sender", pipe)

    def send_all(comm: Any, tensors: Any, buffer: int) -> None:
        if fail.is_set():
            next(tensors)
            raise RuntimeError("an engine left the group")
        nccl_sender.broadcast(comm, tensors, buffer, device=torch.device("cpu"))

    senders = {
        r: nccl_sender.NcclSender(None, r, endpoint=endpoint, send_all=send_all) for r in (0, 1)
    }
    engine = _vllm_engine(monkeypatch, _Queue("engine", pipe))
    wire = NcclWire()

    def sync(generation: int, version: str = "", keep: tuple[str, ...] = ()) -> dict[int, Any]:
        """One sync as the controller drives it: rank 0's rendezvous, the engine's init once
        a generation, then its start, its receive while the owners send, and its finish."""
        rv = senders[0].rendezvous("127.0.0.1", 2, generation, 30.0, 8_000).to_dict()
        senders[1].join(rv, 1)
        if (generation, rv["prefix"]) != getattr(engine, "generation", None):
            engine.init_transfer_engine(engine.parse_init_info(wire.init_payload(rv, 1)))
            engine.generation = (generation, rv["prefix"])
        engine.model.loaded = {}

        def part(rank: int, group: Any) -> Any:
            senders[rank].group = group
            senders[rank].stage(plan, rank, [1], lambda p: values[rank][p.key])
            if rank == 0 and fail.is_set():
                with pytest.raises(RuntimeError, match="left the group"):
                    senders[0].send()
                return None
            if rank == 0:  # the engine receives while rank 0 sends
                engine.start_weight_update()
                update = wire.update_payload(plan, version, list(keep))
                receiving = threading.Thread(target=engine.update_weights, args=(update,))
                receiving.start()
                out = senders[0].send()
                receiving.join(30)
                engine.finish_weight_update()
                return out
            return senders[1].send()

        return _on_ranks(2, part)

    sent = sync(1, "v1", ("v1",))
    assert engine.model.loaded.keys() == weights.keys()
    for name, t in weights.items():
        assert torch.equal(engine.model.loaded[name], t), name
        assert torch.equal(engine.kept["v1"][name], t), name  # kept as received
    assert engine.layerwise == ["start", "end"]
    assert sent[0][0] == sum(t.numel() * t.element_size() for t in weights.values())
    assert 0 < sent[1][0] < sent[0][0]  # owner 1 sent its half, rank 0 moved all of it
    init = engine.joined[0]
    assert (init.rank_offset, init.world_size, init.packed_buffer_size_bytes) == (1, 2, 8_000)

    sync(1, "v2", ("v1", "v2"))  # the same generation: the endpoint stays open
    assert opened == [(1, 2, "nccl")]
    assert engine.kept.keys() == {"v1", "v2"}

    fail.set()
    with contextlib.suppress(Exception):
        sync(1)
    assert senders[0].communicator is None  # the failed send dropped it
    fail.clear()
    while not pipe.empty():
        pipe.get()
    sync(2, "v3", ("v2", "v3"))
    assert opened == [(1, 2, "nccl"), (2, 2, "nccl")]
    assert engine.model.loaded.keys() == weights.keys()
    assert engine.kept.keys() == {"v2", "v3"}  # v1 left the window


def test_nccl_needs_cuda_on_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.workers.sampler.collective import Rendezvous

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this machine
    rv = Rendezvous.new("127.0.0.1", 1, 2, 1, backend="nccl", bucket_bytes=1)
    with pytest.raises(RuntimeError, match="'nccl' needs CUDA on trainer rank 0"):
        nccl_sender.open_endpoint(rv)
