"""The collective transport's bucket plan and its group (``workers/sampler/collective.py``):
whole tensors per bucket, the same plan from the same schema, a tensor larger than a bucket
refused naming the flag; a group of three threads broadcasts a set exactly."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
import torch

from trainctl.workers.sampler import collective
from trainctl.workers.sampler.transport import schema_of


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "z.w": torch.randn(64, 64, generator=g),
        "a.b": torch.randn(300, generator=g).to(torch.bfloat16),
        "m.i": torch.arange(17),
        "k.x": torch.randn(2, 3, 4, generator=g),
    }


def test_plan_keeps_whole_tensors_within_a_bucket_in_name_order() -> None:
    schema = schema_of(_weights())
    buckets = collective.plan(schema, 17_000)
    assert [n for b in buckets for n in b] == sorted(schema)
    assert len(buckets) > 1
    for b in buckets:
        assert sum(collective.nbytes(schema[n]) for n in b) <= 17_000
    assert collective.plan(schema, 17_000) == buckets
    with pytest.raises(ValueError, match=r"sampler_bucket_mb: z\.w is 0\.0 MiB"):
        collective.plan(schema, 1000)


def test_a_group_broadcasts_every_bucket_exactly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rv = collective.Rendezvous.new("127.0.0.1", port, 2, generation=7, timeout_s=30)
    weights = _weights()
    p = collective.Plan.of(schema_of(weights), 17_000)
    got: dict[int, dict[str, torch.Tensor]] = {}

    def receive(rank: int) -> None:
        got[rank] = collective.receive(collective.open_group(rv, rank), p.schema, p.buckets)

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sent = collective.send(collective.open_group(rv, 0), weights, p.buckets)
    for t in threads:
        t.join(30)
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    for rank in (1, 2):
        assert got[rank].keys() == weights.keys()
        for name, t in weights.items():
            assert got[rank][name].dtype == t.dtype and torch.equal(got[rank][name], t), name


def test_the_collective_transport_refuses_gpu_engines_and_a_bucket_too_small() -> None:
    from trainctl.workers.control.samplers import SamplerSettings, check_collective
    from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig
    from trainctl.workers.sampler.pool import PoolOptions

    def settings(gpus: float, bucket_mb: int) -> SamplerSettings:
        pool = PoolOptions(num_samplers=2, num_gpus=gpus)
        return SamplerSettings(pool=pool, transport="collective", bucket_mb=bucket_mb)

    qwen3 = EngineConfig(model=ModelConfig(vocab_size=151936, hidden_size=1024))
    check_collective(qwen3, settings(0, 1024))  # 594 MiB of embedding fits a 1 GiB bucket
    with pytest.raises(ConfigError, match=r"sampler_bucket_mb: 256 MiB is smaller .* 594 MiB"):
        check_collective(qwen3, settings(0, 256))
    with pytest.raises(ConfigError, match="sampler_transport: 'collective' runs on CPU"):
        check_collective(qwen3, settings(1, 1024))


def test_a_window_past_the_engines_host_memory_is_refused_naming_the_flag() -> None:
    from trainctl.service.launch import check_kept_memory
    from trainctl.workers.control.samplers import SamplerSettings
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

    async def stage_broadcast(self, bucket: int, receivers: int, generation: int, t: float) -> Any:
        self.staged.append((receivers, generation))
        return "plan", 10, {"generation": generation}

    async def broadcast_staged(self) -> int:
        self.sending.set()
        await asyncio.wait_for(self.receiving.wait(), 5)
        if self.fail:
            raise RuntimeError("a receiver left the group")
        return 10

    async def to_object_store(self, adapter: str | None) -> Any:
        raise AssertionError("the collective never uses the object store")


def test_the_collective_transport_delivers_with_the_receive_and_reforms_its_group() -> None:
    from trainctl.workers.sampler.transport import CollectiveTransport, Link

    async def run() -> list[Any]:
        t, engines, source = CollectiveTransport(1 << 20), _Engines(), _Source()
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
    rv = {"generation": 1}
    assert seen[0] == (1, {0: 1, 1: 2}, (rv, 2), None)
    assert seen[1][0] == 1  # the same engines: the same group
    assert seen[2] == (2, {1: 1}, ({"generation": 2}, 1), None)  # engine 0 left
    assert seen[3][0] == 2
    assert seen[4][0] == 3  # the failed send dropped generation 2
