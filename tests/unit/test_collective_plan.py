"""The collective transport's bucket plan and its group (``workers/sampler/collective.py``):
whole tensors per bucket, the same plan from the same schema, a tensor larger than a bucket
refused naming the flag; a group of three threads broadcasts a set exactly."""

from __future__ import annotations

import socket
import threading

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
