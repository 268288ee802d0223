"""The gateway's routes, one module per resource, each under ``/v1``."""

from fastapi import FastAPI

from trainctl.service.routes import checkpoints, operations, profiles, service, training


def include(app: FastAPI) -> None:
    for module in (training, operations, profiles, checkpoints, service):
        app.include_router(module.router)
