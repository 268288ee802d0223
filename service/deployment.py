"""The Ray Serve adapter: wires the FastAPI gateway to Ray, nothing more."""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from trainctl.service.app import DEFAULT_MAX_BODY_BYTES, create_app
from trainctl.service.controller_client import RayController
from trainctl.workers.control import logs

DEPLOYMENT_NAME = "trainctl-gateway"
APP_NAME = "trainctl"


def gateway(
    *,
    controller_name: str,
    namespace: str,
    max_ongoing_requests: int = 64,
    api_token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    fault_injection: bool = False,
) -> Any:
    """A bound Serve application serving the gateway for the named controller actor."""
    logs.configure()
    app = create_app(
        RayController(controller_name, namespace),
        api_token=api_token,
        max_body_bytes=max_body_bytes,
        fault_injection=fault_injection,
    )
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        # The gateway only validates and forwards: it needs no CPU reservation of its own.
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests,
    )(serve.ingress(app)())
    return deployment.bind()


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for ``serve deploy`` / KubeRay ``serveConfigV2``.

    ``import_path: trainctl.service.deployment:app_builder`` with ``args``:
        engine             engine config dict (model, layout, optimizer, ...;
                           workers/engine/config.py)
        checkpoint         Hugging Face Llama-style directory to start from (sets the model)
        profile_root       server-side directory for memory profiles
        rank_num_cpus      CPUs reserved per rank actor (default 1)
        rank_num_gpus      GPUs per rank actor (default 1 if the cluster has GPUs, else 0)
        max_ongoing_requests
        max_body_mb        largest request body (MiB; default 256)
        data_root          server-side root of checkpoints/ and exports/ (a shared volume)
        checkpoint_every_steps, keep_checkpoints
        max_queued_operations

    Creates the controller actor (detached, once: a redeploy reuses it) and starts building
    the ranks in the background; ``/v1/ready`` turns 200 when every rank is built.
    """
    import ray

    from trainctl.workers.control.controller import CONTROLLER_NAME, NAMESPACE, ControllerActor
    from trainctl.workers.engine.config import EngineConfig

    engine = dict(args.get("engine", {}))
    if args.get("checkpoint"):  # a Hugging Face Llama-style directory to start from
        from pathlib import Path

        from trainctl.workers.engine import hf

        engine = hf.engine_dict_from(Path(args["checkpoint"]), engine)
    cfg = EngineConfig.from_dict(engine).validate().to_dict()
    has_gpus = bool(ray.cluster_resources().get("GPU"))  # type: ignore[no-untyped-call,unused-ignore]
    gpus = float(args.get("rank_num_gpus", 1 if has_gpus else 0))
    controller = ControllerActor.options(  # type: ignore[attr-defined,unused-ignore]
        name=CONTROLLER_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
    ).remote(
        cfg,
        profile_root=str(args.get("profile_root", "/tmp/trainctl/profiles")),
        rank_num_cpus=float(args.get("rank_num_cpus", 1)),
        rank_num_gpus=gpus,
        max_queued_operations=int(args.get("max_queued_operations", 64)),
        data_root=str(args.get("data_root", "/tmp/trainctl")),
        resume=bool(args.get("resume", True)),
        checkpoint_every_steps=int(args.get("checkpoint_every_steps", 0)),
        keep_checkpoints=int(args.get("keep_checkpoints", 3)),
    )
    controller.start_once.remote()  # type: ignore[attr-defined]
    return gateway(
        controller_name=CONTROLLER_NAME,
        namespace=NAMESPACE,
        max_ongoing_requests=int(args.get("max_ongoing_requests", 64)),
        api_token=os.environ.get("TRAINCTL_API_TOKEN") or None,  # the chart's Secret
        max_body_bytes=int(float(args.get("max_body_mb", 256)) * 2**20),
    )
