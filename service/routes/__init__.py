"""The gateway's routes, one module per resource, each under ``/v1``."""

from fastapi import FastAPI

from trainctl.service.routes import (
    adapters,
    checkpoints,
    operation_routes,
    profiles,
    sampling,
    service,
    timeline,
    training,
)


def include(app: FastAPI) -> None:
    for module in (
        training, operation_routes, profiles, checkpoints, adapters, sampling, service, timeline
    ):  # fmt: skip
        app.include_router(module.router)
