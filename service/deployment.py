"""The Ray Serve adapter: wires the FastAPI gateway to Ray, nothing more."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig

from trainctl.service import launch
from trainctl.service.app import create_app
from trainctl.service.controller_client import RayController
from trainctl.service.settings import Settings
from trainctl.workers.rank import logs

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "trainctl-gateway"
APP_NAME = "trainctl"


def gateway(
    *,
    controller_name: str,
    namespace: str,
    max_ongoing_requests: int = 1024,
    max_queued_requests: int = 1024,
    **app_settings: Any,
) -> Any:
    """A bound Serve application serving the gateway for the named controller actor;
    ``app_settings`` are ``create_app``'s (token, limits, fault injection)."""
    logs.configure()
    app = create_app(RayController(controller_name, namespace), **app_settings)
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        # The gateway only validates and forwards: it needs no CPU reservation of its own. It
        # runs on the head node, beside the controller: it holds the Tinker sessions and
        # futures, and must not share the fate of a worker node, which may leave.
        ray_actor_options={"num_cpus": 0, "resources": {launch.HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=max_ongoing_requests,
        # Past both, Serve's proxy answers at once (a 429 with Retry-After, as the service's
        # own bounds do) instead of holding requests without end.
        max_queued_requests=max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        # A stopping replica polls for its requests to finish (up to Serve's 20 s timeout);
        # Serve's default poll, 2 s, made every stop wait 2 s after the work was done.
        graceful_shutdown_wait_loop_s=0.2,
    )(serve.ingress(app)())
    return deployment.bind()


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for ``serve deploy`` / KubeRay ``serveConfigV2``.

    ``import_path: trainctl.service.deployment:app_builder``. Each key of ``args`` is a
    ``trainctl serve`` setting (``service/settings.py``) and ranks as its flag; ``engine`` is
    the engine config, ranking as ``--engine-config``'s file. E.g.::

        args:
          engine: {layout: {dp: 2, tp: 4}, model: {seed: 1234}}
          rank_num_cpus: 1
          rank_num_gpus: 1
          data_dir: /data
          init_hf: /data/models/Llama-3.2-1B   # a Hugging Face checkpoint to start from

    Creates the controller actor (detached, once: a redeploy reuses it) and starts building
    the ranks in the background; ``/v1/ready`` turns 200 when every rank is built.
    """
    s = launch.settings_from_args(args)
    logs.configure(s.log_level, s.log_format)
    if not s.has_credentials():  # Serve's proxy host is not ours to see
        log.warning(
            "no API token (api_token_file): anyone who reaches the Serve proxy can train, "
            "load and export; give api_token_file unless the proxy listens on loopback only"
        )
    controller = launch.create_controller(s, launch.engine_config(s), detached=True)
    controller.start_once.remote()
    return gateway_app(s)


def gateway_app(s: Settings, instance_id: str = "") -> Any:
    """The bound Serve application of the gateway, for the controller ``create_controller``
    made; ``instance_id``: what its health checks report (``s.instance_id`` wins)."""
    from trainctl.workers.control.controller import CONTROLLER_NAME, NAMESPACE

    return gateway(
        controller_name=CONTROLLER_NAME,
        namespace=NAMESPACE,
        max_ongoing_requests=s.max_ongoing_requests,
        max_queued_requests=s.max_queued_requests,
        api_token=s.token(),
        api_keys_file=None if s.api_keys is None else str(s.api_keys.resolve()),
        max_body_bytes=int(s.max_body_mb * 2**20),
        body_timeout_s=s.body_timeout_s,
        max_sequences=s.max_sequences,
        max_tokens_per_request=s.max_tokens_per_request,
        fault_injection=s.enable_fault_injection,
        tinker_bounds=launch.tinker_bounds(s),
        open_metrics=s.open_metrics,
        open_docs=s.open_docs,
        instance_id=s.instance_id or instance_id,
        trace_spans=s.trace_spans,
        otlp_endpoint=s.otlp_endpoint,
    )
