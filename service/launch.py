"""One launch path: ``trainctl serve`` and the Serve application used by KubeRay and
``serve deploy`` both build the engine config, the controller and the gateway here, from one
``Settings`` (``service/settings.py``) with one set of defaults.

What the controller actor takes is typed, built here once: the ``EngineConfig``, the
``ControllerOptions`` and the ``SamplerSettings``. Precedence, for every setting that shapes
the engine (a field marked with its place in the engine config, ``engine_settings()``): flag
or Serve arg > environment > engine config file (or inline ``engine``) > default.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

from trainctl.service.settings import Settings, engine_settings

if TYPE_CHECKING:
    from trainctl.service.shares import Bounds
    from trainctl.workers.control.controller import ControllerOptions
    from trainctl.workers.control.sampler_settings import SamplerSettings
    from trainctl.workers.engine.config import EngineConfig

HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The resource only Ray's head node has."""


def engine_config(s: Settings) -> EngineConfig:
    """The validated engine config: the file's values, overridden by the settings given as a
    flag or in the environment, and the settings' defaults where the file is silent."""
    from trainctl.workers.engine.config import EngineConfig

    base = copy.deepcopy(s.engine_file())
    for name, place in engine_settings().items():
        *sections, key = place.split(".")
        target = base
        for section in sections:
            target = target.setdefault(section, {})
        if name in s.model_fields_set or key not in target:
            target[key] = getattr(s, name)
    lora = base.setdefault("lora", {})
    if not lora.get("offload_dir"):  # where idle adapters wait on disk
        lora["offload_dir"] = str((s.data_dir / "adapters").resolve())
    if s.init_hf is not None:
        from trainctl.workers.engine import hf

        base = hf.engine_dict_from(s.init_hf, base)
    cfg = EngineConfig.from_dict(base).validate()
    if s.api_keys is not None and not cfg.lora.max_adapters:
        # Tenants share one frozen base, each training adapters of its own: a service that
        # trains the full model cannot keep them apart.
        raise ValueError(
            "api_keys: each tenant trains adapters of its own on a frozen base; start the "
            "service with --max-adapters N"
        )
    return cfg


def controller_options(s: Settings, *, rank_num_gpus: float) -> ControllerOptions:
    """How the controller runs, besides the engine config and the samplers."""
    from trainctl.workers.control.controller import ControllerOptions

    return ControllerOptions(
        data_root=str(s.data_dir.resolve()),
        profile_root=str(s.profiles_dir()),
        rank_num_cpus=s.rank_num_cpus,
        rank_num_gpus=rank_num_gpus,
        max_queued_operations=s.max_queued_operations,
        checkpoint_every_steps=s.checkpoint_every_steps,
        keep_checkpoints=s.keep_checkpoints,
        resume=s.resume_target(),
        checkpoint_format=s.checkpoint_format,
        peer_recovery=s.peer_recovery,
        on_node_loss=s.on_node_loss,
        async_save=s.async_save,
        metrics_log=s.metrics_log,
        max_staleness=s.max_staleness,
    )


def create_controller(s: Settings, cfg: EngineConfig, *, detached: bool) -> Any:
    """The named controller actor (on a connected Ray). ``detached`` (Serve): it outlives the
    application's builder, and a redeploy finds and reuses it. A ``ConfigError`` if the
    sampler engines cannot serve this model as asked, before anything starts."""

    from trainctl.workers.control.controller import CONTROLLER_NAME, NAMESPACE, ControllerActor
    from trainctl.workers.control.sampler_settings import check_engines

    gpus = _gpus_per_actor(s.rank_num_gpus)
    env = {
        "TRAINCTL_LOG_LEVEL": s.log_level,
        "TRAINCTL_LOG_FORMAT": s.log_format,
        "TRAINCTL_TRACE_SPANS": str(s.trace_spans),
        "TRAINCTL_OTLP_ENDPOINT": s.otlp_endpoint or "",
        # matplotlib (the memory-profile pictures) keeps its caches under the data directory,
        # not in the home directory.
        "MPLCONFIGDIR": str(s.data_dir.resolve() / "cache" / "matplotlib"),
    }
    options: dict[str, Any] = {
        "name": CONTROLLER_NAME,
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "runtime_env": {"env_vars": env},
        # On the head node (Ray marks it with this resource), wherever the launch runs: the
        # controller holds the service's state and must not share the fate of a worker node,
        # which may leave.
        "resources": {HEAD_NODE_RESOURCE: 0.001},
    }
    if detached:
        options.update(lifetime="detached", get_if_exists=True)
    samplers = sampler_settings(s)
    if samplers.pool.num_samplers:
        check_engines(cfg, samplers)  # what the engines cannot do: said before any rank starts
        check_kept_memory(cfg, samplers)
    return ControllerActor.options(**options).remote(
        cfg, controller_options(s, rank_num_gpus=gpus), samplers
    )


def tinker_bounds(s: Settings) -> Bounds:
    """The bounds of the gateway's tables, each shared out among the tenants and the
    operator (``service/shares.py``); the adapters' is the controller's ``--max-adapters``."""
    from trainctl.service.shares import Bounds

    return Bounds(
        sessions=s.tinker_max_sessions, models=s.tinker_max_models, futures=s.tinker_max_futures,
        sampling_clients=s.tinker_max_sampling_clients, parked=s.tinker_max_parked,
        parked_bytes=int(s.tinker_max_parked_mb * 2**20), samples=s.sampler_max_queued,
        operations=s.max_queued_operations,
    )  # fmt: skip


def sampler_settings(s: Settings) -> SamplerSettings:
    """The controller's ``SamplerSettings`` (on a connected Ray: GPUs are looked up)."""
    from trainctl.workers.control.sampler_settings import SamplerSettings
    from trainctl.workers.sampler.pool import PoolOptions

    gpus = _gpus_per_actor(s.sampler_num_gpus)
    dtype = s.sampler_dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpus else "float32"
    pool = PoolOptions(
        num_samplers=s.samplers, num_cpus=s.sampler_num_cpus, num_gpus=gpus, sync=s.sampler_sync,
        versions=s.sampler_versions,
        call_timeout_s=s.sampler_timeout_s, queue_timeout_s=s.sampler_queue_timeout_s,
        max_queued=s.sampler_max_queued, max_queued_tokens=s.sampler_max_queued_tokens,
        cache_dir=str(s.data_dir.resolve() / "cache" / "samplers"),
    )  # fmt: skip
    return SamplerSettings(
        pool=pool,
        backend=s.sampler_backend,
        dtype=dtype,
        kv_cache_gib=s.sampler_kv_cache_gib,
        routes=s.sampler_routes,
        concurrency=s.sampler_concurrency,
        transport=s.sampler_transport,
        bucket_mb=s.sampler_bucket_mb,
        collective_backend=s.sampler_collective_backend,
        host_memory_gib=s.sampler_host_memory_gib or _host_memory_gib() / 2 / max(s.samplers, 1),
    )


def check_kept_memory(cfg: EngineConfig, samplers: SamplerSettings) -> None:
    """With the collective transport, a ConfigError if the versions every engine keeps in host
    memory do not fit its budget: the model's parameters counted on transformers' meta device,
    at bf16 unless the ranks are set to fp32 (never an overcount; the first sync checks the
    exact bytes again)."""
    from trainctl.workers.control.sampler_settings import check_kept
    from trainctl.workers.engine import hf

    if samplers.transport != "collective" or not samplers.host_memory_gib:
        return
    itemsize = 4 if cfg.precision == "fp32" else 2
    nbytes = itemsize * hf.parameter_count(cfg.model)
    check_kept(samplers.pool.versions, nbytes, samplers.host_memory_gib)


def _host_memory_gib() -> float:
    """This node's memory, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _gpus_per_actor(setting: float | None) -> float:
    """A per-actor GPU setting, or its default on a connected Ray: 1 when the cluster has
    GPUs, else 0."""
    import ray

    if setting is not None:
        return setting
    return 1.0 if ray.cluster_resources().get("GPU") else 0.0


def settings_from_args(args: dict[str, Any]) -> Settings:
    """The Serve application's ``args`` as settings: each key a setting, ranking as a flag."""
    unknown = sorted(set(args) - set(Settings.model_fields))
    if unknown:
        raise ValueError(
            f"unknown application args {unknown}; each arg is a `trainctl serve` setting "
            f"(one of {sorted(Settings.model_fields)})"
        )
    return Settings(**args)
