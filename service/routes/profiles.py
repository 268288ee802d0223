"""Memory profiles: start and stop (operations), then list, read and download."""

from fastapi import Response

from trainctl.api import MemoryProfileList, MemoryProfileResult
from trainctl.service.routes.deps import ControllerDep, resource_router
from trainctl.service.routes.operation_routes import add_operation_routes

router = resource_router("profiling")
add_operation_routes(router, "profiling")


@router.get("/memory_profiles", response_model=MemoryProfileList)
async def list_memory_profiles(controller: ControllerDep) -> MemoryProfileList:
    """The profiles taken, oldest first, with each rank's file and picture."""
    return await controller.list_profiles()


@router.get("/memory_profiles/{profile_id}", response_model=MemoryProfileResult)
async def get_memory_profile(profile_id: str, controller: ControllerDep) -> MemoryProfileResult:
    return await controller.get_profile(profile_id)


@router.get(
    "/memory_profiles/{profile_id}/files/{name}",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}, "image/png": {}}}},
)
async def download_memory_profile_file(
    profile_id: str, name: str, controller: ControllerDep
) -> Response:
    """One rank's profile file (Chrome trace or CUDA snapshot) or its PNG picture."""
    data = await controller.read_profile_file(profile_id, name)
    media = {"png": "image/png", "json": "application/json"}.get(
        name.rsplit(".", 1)[-1], "application/octet-stream"
    )
    return Response(
        data, media_type=media, headers={"Content-Disposition": f'attachment; filename="{name}"'}
    )
