"""The Ray Serve adapter: wires the FastAPI gateway to Ray, nothing more."""

from __future__ import annotations

from typing import Any

from ray import serve

from trainctl.service.app import create_app
from trainctl.service.controller_client import RayController

DEPLOYMENT_NAME = "trainctl-gateway"
APP_NAME = "trainctl"


def gateway(*, controller_name: str, namespace: str, max_ongoing_requests: int = 64) -> Any:
    """A bound Serve application serving the gateway for the named controller actor."""
    app = create_app(RayController(controller_name, namespace))
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        # The gateway only validates and forwards: it needs no CPU reservation of its own.
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests,
    )(serve.ingress(app)())
    return deployment.bind()


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for ``serve deploy`` configs.

    ``import_path: trainctl.service.deployment:app_builder``.

    The controller actor must already run (``trainctl serve`` or ``trainctl controller``).
    """
    from trainctl.workers.controller import CONTROLLER_NAME, NAMESPACE

    return gateway(
        controller_name=args.get("controller_name", CONTROLLER_NAME),
        namespace=args.get("namespace", NAMESPACE),
        max_ongoing_requests=int(args.get("max_ongoing_requests", 64)),
    )
