"""The samplers' settings as the controller takes them, and the refusals they meet before any
engine starts: what the engines' backend cannot do for the model, a collective wire the engines
cannot speak where they run, and a window of versions that does not fit where it is kept. Each
refusal is one line naming its flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainctl.workers.engine.config import ConfigError, EngineConfig
from trainctl.workers.sampler import backend
from trainctl.workers.sampler.backend import SamplerNeeds, UnsupportedError
from trainctl.workers.sampler.pool import PoolOptions


@dataclass(frozen=True)
class SamplerSettings:
    """``trainctl serve``'s sampler settings, as the controller takes them: the pool's as
    they are, and what the engines' ``SamplerSpec`` takes besides the model's config (which
    only the ranks know)."""

    pool: PoolOptions = field(default_factory=lambda: PoolOptions(num_samplers=0))
    backend: str = "vllm"
    """``--sampler-backend``: the engines' backend (``workers/sampler/backend.py``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    kv_cache_gib: int = 1
    routes: bool = False
    """``--sampler-routes``: the engines capture the experts each token was routed to."""
    concurrency: int = 64
    """``--sampler-concurrency``: requests of one version an engine runs at once."""
    transport: Literal["object_store", "collective"] = "object_store"
    """``--sampler-transport``: how the base's weights reach the engines (adapters always
    travel through the object store)."""
    bucket_mb: int = 64
    """``--sampler-bucket-mb``: MiB of one bucket of a sync: what an owner converts at once."""
    host_memory_gib: float = 0.0
    """``--sampler-host-memory-gib``, resolved: the host memory each engine may give the
    versions it keeps over the collective transport (0: unchecked)."""
    collective_backend: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """``--sampler-collective-backend``: the wire of the collective transport
    (``workers/sampler/wires.py``); ``auto``: ``gloo`` for CPU engines, ``nccl`` for GPU
    engines (``wire``)."""

    @property
    def wire(self) -> str:
        """The collective's wire, ``auto`` resolved by where the engines run."""
        if self.collective_backend != "auto":
            return self.collective_backend
        return "nccl" if self.pool.num_gpus > 0 else "gloo"


def check_window(versions: int, nbytes: int, capacity: float) -> None:
    """A ConfigError if ``versions`` copies of the weights (``nbytes`` each) cannot fit in
    Ray's object store (``capacity`` bytes; 0: unknown), where the window keeps them."""
    if capacity and versions * nbytes > capacity:
        raise ConfigError(
            f"sampler_versions: {versions} versions of the weights ({nbytes / 2**30:.2f} GiB "
            f"each) do not fit in Ray's object store ({capacity / 2**30:.2f} GiB): lower "
            "--sampler-versions, or give Ray more object store memory"
        )


def check_kept(versions: int, nbytes: int, budget_gib: float) -> None:
    """A ConfigError if ``versions`` copies of the weights (``nbytes`` each), which every
    engine keeps in host memory over the collective transport, exceed its budget."""
    if budget_gib and versions * nbytes > budget_gib * 2**30:
        raise ConfigError(
            f"sampler_host_memory_gib: each sampler engine keeps --sampler-versions {versions} "
            f"versions of the weights ({nbytes / 2**30:.2f} GiB each) in host memory over the "
            f"collective transport, more than its {budget_gib:g} GiB: lower --sampler-versions, "
            "raise --sampler-host-memory-gib, or take --sampler-transport object_store"
        )


def check_engines(cfg: EngineConfig, s: SamplerSettings) -> None:
    """A ConfigError naming what the engines' backend cannot do for this model, said before
    any engine starts (the rules live with the backend: ``check``)."""
    needs = SamplerNeeds(
        gpus=s.pool.num_gpus,
        moe=bool(cfg.model.num_experts),
        linear_attention=bool(cfg.model.linear_layers),
        lora=cfg.lora.enabled,
        routes=s.routes,
    )
    try:
        backend.load(s.backend).check(needs)
    except UnsupportedError as e:
        raise ConfigError(str(e)) from None
    if s.transport == "collective":
        check_collective(cfg, s)


def check_collective(cfg: EngineConfig, s: SamplerSettings) -> None:
    """The collective transport's refusals before any engine starts, each one line naming
    its flag: a wire the engines cannot speak where they run (``gloo`` is for CPU engines;
    vLLM's ``nccl`` communicator turns itself off silently on a CPU, so it is never let move
    nothing there; ``ipc`` needs engines on the trainer's own GPUs, which trainctl never
    places). The engines' host-memory budget is checked by the launch (``check_kept``, which
    counts the model's parameters with torch, which the controller never imports)."""
    wire, gpus = s.wire, s.pool.num_gpus > 0
    if wire == "ipc":
        raise ConfigError(
            "sampler_collective_backend: 'ipc' shares CUDA memory with engines on the "
            "trainer's own GPUs, and trainctl places each sampler engine on GPUs of its own: "
            "take 'nccl'"
        )
    if wire == "nccl" and not gpus:
        raise ConfigError(
            "sampler_collective_backend: 'nccl' needs GPU sampler engines (vLLM's NCCL "
            "communicator turns itself off on a CPU and moves nothing): CPU engines take 'gloo'"
        )
    if wire == "gloo" and gpus:
        raise ConfigError(
            "sampler_collective_backend: 'gloo' is for CPU sampler engines: GPU engines take "
            "'nccl' (or --sampler-transport object_store)"
        )
