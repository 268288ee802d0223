"""The streamed plan's buckets (``workers/sampler/stream.py``) and the collective's group
(``workers/sampler/collective.py``): each owner's pieces in buckets, the owners interleaved;
two owners and two receivers in one group of threads move a set exactly; the transport's
delivery, generations and refusals."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
import torch

from trainctl.workers import rendezvous
from trainctl.workers.sampler import collective
from trainctl.workers.sampler.stream import Piece, StreamPlan
from trainctl.workers.sampler.transport import schema_of


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "z.w": torch.randn(64, 64, generator=g),
        "a.b": torch.randn(300, generator=g).to(torch.bfloat16),
        "m.i": torch.arange(17),
        "k.x": torch.randn(2, 3, 4, generator=g),
    }


def _halves(weights: dict[str, torch.Tensor]) -> tuple[StreamPlan, dict[int, Any]]:
    """Two owners: rank 0 holds the first half of every tensor's rows, rank 3 the rest (a
    one-row tensor whole on rank 0), as TP shards are; the plan and each owner's values."""
    pieces: dict[int, list[Piece]] = {0: [], 3: []}
    values: dict[int, dict[Any, torch.Tensor]] = {0: {}, 3: {}}
    for name, t in sorted(weights.items()):
        dtype, full = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        cut = t.shape[0] // 2 if t.shape[0] > 1 else t.shape[0]
        for owner, (start, part) in ((0, (0, t[:cut])), (3, (cut, t[cut:]))):
            if part.shape[0] == 0:
                continue
            p = Piece(name, 0, start, tuple(part.shape), dtype, full, direct=part.numel() > 1000)
            pieces[owner].append(p)
            values[owner][p.key] = part
    return StreamPlan.of(pieces, 5_000), values


def test_the_plan_buckets_each_owner_and_interleaves_them() -> None:
    plan, _ = _halves(_weights())
    assert plan.owners == (0, 3) and len(plan.buckets) > 2
    for b in plan.buckets:  # a bucket is one owner's, within the size, or one piece alone
        assert b.nbytes <= 5_000 or len(b.pieces) == 1
    assert [b.owner for b in plan.buckets[:2]] == [0, 3]  # the owners send side by side
    assert plan.schema == schema_of(_weights())
    tags = [t for i in range(len(plan.buckets)) for t in plan.tags(i)]
    assert tags == list(range(len(tags)))
    assert StreamPlan.from_dict(plan.to_dict()) == plan


def test_two_owners_send_their_halves_to_two_receivers_exactly() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    rv = collective.Rendezvous.new(
        "127.0.0.1", listener.getsockname()[1], 4, generation=7, timeout_s=30
    )
    gate = rendezvous.Gate(listener, rv.prefix)  # rank 0's: only members get through
    weights = _weights()
    plan, values = _halves(weights)
    got: dict[int, dict[str, torch.Tensor]] = {}
    sent: dict[int, int] = {}

    def receive(rank: int) -> None:
        got[rank] = collective.receive(collective.open_group(rv, rank).group, plan)

    def send(rank: int, owner: int) -> None:
        joined = collective.open_group(rv, rank, gate if rank == 0 else None)
        sent[owner], _ = collective.send(
            joined.group, plan, owner, [2, 3], lambda p: values[owner][p.key]
        )

    threads = [threading.Thread(target=receive, args=(r,)) for r in (2, 3)]
    threads.append(threading.Thread(target=send, args=(1, 3)))
    for t in threads:
        t.start()
    send(0, 0)
    for t in threads:
        t.join(30)
    gate.close()
    assert gate.refused == 0
    assert sum(sent.values()) == sum(t.numel() * t.element_size() for t in weights.values())
    assert sent[0] > 0 and sent[3] > 0
    for rank in (2, 3):
        assert got[rank].keys() == weights.keys()
        for name, t in weights.items():
            assert got[rank][name].dtype == t.dtype and torch.equal(got[rank][name], t), name


def test_each_wire_is_refused_where_its_engines_cannot_speak_it_in_one_line() -> None:
    from trainctl.workers.control.sampler_settings import SamplerSettings, check_collective
    from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig
    from trainctl.workers.sampler.pool import PoolOptions

    def settings(gpus: float, wire: Any = "auto") -> SamplerSettings:
        pool = PoolOptions(num_samplers=2, num_gpus=gpus)
        return SamplerSettings(pool=pool, transport="collective", collective_backend=wire)

    qwen3 = EngineConfig(model=ModelConfig(vocab_size=151936, hidden_size=1024))
    assert (settings(0).wire, settings(1).wire) == ("gloo", "nccl")  # auto: by the engines
    check_collective(qwen3, settings(0))  # a tensor larger than a bucket travels alone
    check_collective(qwen3, settings(1))
    refusals = {
        "sampler_collective_backend: 'nccl' needs GPU sampler engines": settings(0, "nccl"),
        "sampler_collective_backend: 'gloo' is for CPU sampler engines": settings(1, "gloo"),
        "sampler_collective_backend: 'ipc' shares CUDA memory": settings(1, "ipc"),
    }
    for message, refused in refusals.items():
        with pytest.raises(ConfigError) as e:
            check_collective(qwen3, refused)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_window_past_the_engines_host_memory_is_refused_naming_the_flag() -> None:
    from trainctl.service.launch import check_kept_memory
    from trainctl.workers.control.sampler_settings import SamplerSettings
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ConfigError, EngineConfig
    from trainctl.workers.sampler.pool import PoolOptions

    cfg = EngineConfig(precision="fp32")
    nbytes = 4 * hf.parameter_count(cfg.model)
    assert nbytes > 1_000_000  # the embedded model: about 2.5 MB in fp32

    def settings(versions: int, gib: float) -> SamplerSettings:
        pool = PoolOptions(num_samplers=2, versions=versions)
        return SamplerSettings(pool=pool, transport="collective", host_memory_gib=gib)

    fits = 3 * nbytes / 2**30
    check_kept_memory(cfg, settings(3, fits))
    with pytest.raises(ConfigError, match=r"^sampler_host_memory_gib: .* --sampler-versions 4 "):
        check_kept_memory(cfg, settings(4, fits))


class _Engines:
    def __init__(self) -> None:
        self.ready = [(0, 100), (1, 101)]

    async def members(self) -> list[tuple[int, int | None]]:
        return list(self.ready)


class _Source:
    """A sender whose broadcast completes only once the receivers have started (as a real
    broadcast does), and which can be made to fail."""

    def __init__(self) -> None:
        self.receiving = self.sending = asyncio.Event()
        self.fail = False
        self.staged: list[tuple[int, int]] = []

    owners = 2

    async def stream_plan(self, bucket_bytes: int) -> StreamPlan:
        """Owners 0 and 1, a tensor each."""
        pieces = {r: [Piece(f"w{r}", 0, 0, (4,), "float32", (4,))] for r in range(self.owners)}
        return StreamPlan.of(pieces, bucket_bytes)

    async def open_collective(
        self, plan: StreamPlan, receivers: int, generation: int, timeout_s: float,
        backend: str = "gloo", bucket_bytes: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        self.staged.append((receivers, generation))
        return {"generation": generation, "backend": backend}

    async def send_collective(self, plan: StreamPlan) -> int:
        self.sending.set()
        await asyncio.wait_for(self.receiving.wait(), 5)
        if self.fail:
            raise RuntimeError("a receiver left the group")
        return 10

    async def to_object_store(self, plan: StreamPlan) -> list[Any]:
        raise AssertionError("the collective never uses the object store")

    async def adapter_to_object_store(self, adapter: str) -> tuple[Any, int]:
        raise AssertionError("the collective never uses the object store")


@pytest.mark.parametrize("wire,first", [("gloo", 2), ("nccl", 1)])
def test_the_collective_transport_delivers_with_the_receive_and_reforms_its_group(
    wire: str, first: int
) -> None:
    """The same control flow for each wire; the engines' ranks follow the senders: both
    owners over gloo, rank 0 alone over nccl."""
    from trainctl.workers.sampler.transport import CollectiveTransport, Link

    async def run() -> list[Any]:
        t, engines, source = CollectiveTransport(1 << 20, backend=wire), _Engines(), _Source()
        seen: list[Any] = []

        async def receive(link: Link | None) -> str:
            assert link is not None
            await asyncio.wait_for(source.sending.wait(), 5)  # the send is under way ...
            source.receiving.set()  # ... and waits for the receive
            seen.append((link.generation, link.ranks, link.member(1), link.member(5)))
            return "loaded"

        for step, change, fail in ((1, None, False), (2, None, False), (3, [(1, 102)], False),
                                   (4, None, True), (5, None, False)):  # fmt: skip
            if change is not None:
                engines.ready = change
            source.fail, source.receiving, source.sending = fail, asyncio.Event(), asyncio.Event()
            await t.connect(engines)
            shipment = await t.send(source, step, None)
            assert shipment.transport == "collective" and shipment.version == step
            assert await t.deliver(source, shipment, receive) == "loaded"
        return seen

    seen = asyncio.run(run())
    rv = {"generation": 1, "backend": wire}
    assert seen[0] == (1, {0: first, 1: first + 1}, (rv, first + 1), None)
    assert seen[1][0] == 1  # the same engines: the same group
    assert seen[2] == (2, {1: first}, (rv | {"generation": 2}, first), None)  # engine 0 left
    assert seen[3][0] == 2
    assert seen[4][0] == 3  # the failed send dropped generation 2
