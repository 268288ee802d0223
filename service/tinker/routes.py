"""The Tinker protocol at ``/api/v1/*``, as the ``tinker`` SDK (0.38) speaks it.

The routes are left out of the OpenAPI schema (their names would collide with the native
routes' operationIds, and ``forward_backward`` takes protobuf). Each training call answers a
future at once and runs as a native operation on the controller, in the model's ``seq_id``
order (``state.py``); ``retrieve_future`` long-polls it for under 45 s and answers
``try_again`` meanwhile. A failure is HTTP 200 with ``{error, category}``.

**Auth** is ``X-API-Key``. The SDK only sends keys starting ``tml-`` (or a JWT), so
``tml-<token>`` passes when ``<token>`` is the service's token, and any ``tml-`` key passes
on a service without one. ``client/dynamic_config`` needs none (the SDK calls it bare).

**One model.** trainctl serves one model, named by ``/v1/info``'s ``model_name``. Every
``create_model`` with that ``base_model`` and LoRA rank 0 (full-parameter training) gets a
handle on it, as long as it has not been trained: a ``create_model`` after a step would
present trained weights as the base model, so it is refused, naming the step and how to go
on (``create_training_client_from_state`` with a saved path, or load a checkpoint saved at
step 0).

One concern, at its length: the Tinker protocol's HTTP surface, one route per SDK call.
What the routes keep is ``state.py``'s, sampling ``sampling_sessions.py``'s, conversion
``convert.py``'s.
"""

import asyncio
import hashlib
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from trainctl.api import (
    ConflictError,
    DeleteCheckpointRequest,
    ExportRequest,
    ExportResult,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    Info,
    InvalidRequestError,
    LoadCheckpointRequest,
    NotFoundError,
    OperationKind,
    OptimStepRequest,
    PayloadTooLargeError,
    SaveCheckpointRequest,
    StepResult,
)
from trainctl.api.operations import fingerprint
from trainctl.service.auth import Access, access, tenant_of
from trainctl.service.codec import read_body
from trainctl.service.routes.deps import get_controller, get_limits
from trainctl.service.shares import Shares
from trainctl.service.tinker import convert, proto, sampling_sessions, trace_export
from trainctl.service.tinker.adapter_slots import AdapterSlots
from trainctl.service.tinker.bodies import (
    AdamParams,
    Body,
    CreateModelRequest,
    CreateSession,
    LoadWeights,
    ModelCall,
    OptimStep,
    SaveForSampler,
    SaveWeights,
    check_create_model,
    json_object,
    text_field,
    validated,
)
from trainctl.service.tinker.compressed import leading_ids, unzstd, unzstd_head
from trainctl.service.tinker.native import future_of, in_order
from trainctl.service.tinker.sampling_table import SamplingSessions
from trainctl.service.tinker.state import Model, TinkerState, model_id_of, native_name

PREFIX = "/api/v1"
LONG_POLL_S = 30.0
"""``retrieve_future`` waits this long before ``try_again`` (the SDK's read timeout is 45 s)."""


def _state(request: Request) -> TinkerState:
    value: TinkerState = request.app.state.tinker
    return value


def _slots(request: Request) -> AdapterSlots:
    value: AdapterSlots = request.app.state.tinker_adapter_slots
    return value


def _in_order(request: Request, model: Model, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``native.in_order`` on this app's controller and Tinker state."""
    return in_order(get_controller(request), _state(request), model, *args, **kwargs)


async def _json(request: Request, model: type[Body]) -> tuple[Any, str]:
    """The body as ``model`` and its fingerprint."""
    return validated(json_object(await read_body(request, request.app.state.max_body_bytes)), model)


async def _model_call(request: Request, model: type[ModelCall]) -> tuple[Any, str, Model]:
    """The body, its fingerprint and the model handle it names. A body refused after its
    model and ``seq_id`` are known passes that ``seq_id``'s turn on, so the model's later
    requests do not wait for it."""
    raw = json_object(await read_body(request, request.app.state.max_body_bytes))
    try:
        req, fp = validated(raw, model)
    except ValidationError as e:
        state, seq_id = _state(request), raw.get("seq_id")
        found = state.find_model(raw.get("model_id"), tenant_of(request))
        if found is not None and type(seq_id) is int:
            state.refuse(found, seq_id, "refused", e)
        raise
    return req, fp, _state(request).model(req.model_id, tenant_of(request))


async def _fields(request: Request) -> dict[str, Any]:
    """A small JSON body read as a plain object (the calls that name one id)."""
    return json_object(await read_body(request, 1 << 16))


async def _info(request: Request) -> Info:
    return await get_controller(request).info()


router = APIRouter(prefix=PREFIX, include_in_schema=False)
"""Every Tinker route; ``install`` mounts it with its state."""


@router.post("/client/dynamic_config")
@access(Access.OPEN)
async def dynamic_config() -> dict[str, Any]:
    return {}


@router.post("/client/config")
@access(Access.TINKER)
async def client_config() -> dict[str, Any]:
    # protobuf forward_backward bodies, zstd-compressed; no JWT exchange
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True}


@router.post("/create_session")
@access(Access.TINKER)
async def create_session(request: Request) -> dict[str, Any]:
    validated(await _fields(request), CreateSession)  # tags and metadata: read, not kept
    session_id = _state(request).create_session(tenant_of(request))
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
@access(Access.TINKER)
async def session_heartbeat(request: Request) -> Response:
    body = await _fields(request)
    s = _state(request).session(text_field(body, "session_id"), tenant_of(request), finished=True)
    if s.finished is not None:
        return JSONResponse({"detail": f"session finished: {s.finished}"}, status_code=410)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
@access(Access.TINKER)
async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
    """The session ends (the first reason wins): its models' adapter slots are freed, its
    sampling clients forgotten, and a later call on either is a 410. What it saved stays."""
    body = await _fields(request)
    state = _state(request)
    s = state.session(session_id, tenant_of(request), finished=True)
    reason = body.get("reason")
    state.finish(s, str(reason.get("type", "success")) if isinstance(reason, dict) else "success")
    return {}


@router.get("/healthz")
@access(Access.OPEN)
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
@access(Access.TINKER)
async def get_server_capabilities(request: Request) -> dict[str, Any]:
    info = await _info(request)
    model = {
        "model_name": info.model_name,
        "max_context_length": info.limits.max_seq_len - 1,  # the input, then one target
        "trainable": True,
        "sampleable": info.samplers is not None,
    }
    return {"supported_models": [model]}


@router.post("/telemetry")
@access(Access.TINKER)
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}  # accepted and dropped


@router.post("/create_model")
@access(Access.TINKER)
async def create_model(request: Request) -> dict[str, Any]:
    req, fp = await _json(request, CreateModelRequest)
    state = _state(request)
    tenant = tenant_of(request)
    state.reserve_model(req.session_id, req.model_seq_id, tenant)  # 404 or 409 now
    model_id = model_id_of(req.session_id, req.model_seq_id)

    async def create() -> dict[str, Any]:
        info = await _info(request)
        controller = get_controller(request)
        adapters = await controller.list_adapters()
        adapter = check_create_model(
            req, info, model_id=model_id, adapter_name=native_name(model_id, tenant),
            max_adapters=adapters.max_adapters,
        )  # fmt: skip
        if adapter is None:
            state.add_model(req.session_id, req.model_seq_id)
        elif adapter.name in {a.name for a in adapters.adapters}:  # a retried create made it
            state.add_model(req.session_id, req.model_seq_id, adapter=adapter.name)
        else:
            async with _slots(request).room(tenant):  # 409 past the tenant's quota
                key = f"tinker:create:{model_id}"
                await controller.run(OperationKind.CREATE_ADAPTER, adapter, key, fp)
                try:
                    state.add_model(req.session_id, req.model_seq_id, adapter=adapter.name)
                except Exception:  # the session ended meanwhile: its slot goes back
                    _slots(request).release([Model(model_id, req.session_id, adapter=adapter.name)])
                    raise
        return {"model_id": model_id, "type": "create_model"}

    key = (req.session_id, req.model_seq_id)
    f = state.once(state.created, key, fp, lambda: state.run("create_model", create, tenant))
    return future_of(f, model_id)


async def _lora_rank(request: Request, model: Model) -> int | None:
    if model.adapter is None:
        return None
    listing = await get_controller(request).list_adapters()
    return next((a.rank for a in listing.adapters if a.name == model.adapter), None)


@router.post("/get_info")
@access(Access.TINKER)
async def get_info(request: Request) -> dict[str, Any]:
    body = await _fields(request)
    model = _state(request).model(text_field(body, "model_id"), tenant_of(request))
    info = await _info(request)
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_name": info.model_name,
        "model_data": {
            "arch": str(info.model["family"]),
            "model_name": info.model_name,
            "tokenizer_id": None,
        },
        "is_lora": model.adapter is not None,
        "lora_rank": await _lora_rank(request, model),
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/forward_backward")
@access(Access.TINKER)
async def forward_backward(request: Request) -> dict[str, Any]:
    zstd = "zstd" in request.headers.get("content-encoding", "").lower()
    head = bytearray()  # the body's start, or (zstd) the whole compressed body once read
    try:
        body = await read_body(request, request.app.state.max_body_bytes, head)
        if zstd:
            head = bytearray(body)
            body = await asyncio.to_thread(unzstd, body, request.app.state.max_body_bytes)
    except PayloadTooLargeError as e:
        # Its seq_id's turn passes on: the model's next request must not wait for it.
        ids = leading_ids(unzstd_head(bytes(head)) if zstd else bytes(head))
        if ids is not None and (found := _state(request).find_model(ids[0], tenant_of(request))):
            _state(request).refuse(found, ids[1], "refused", e)
        raise
    msg = proto.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:
        raise InvalidRequestError(f"body: not a ForwardBackwardRequest protobuf ({e})") from e
    model = _state(request).model(msg.model_id, tenant_of(request))
    limits = await get_limits(request, get_controller(request))

    def native() -> ForwardBackwardRequest:
        req = convert.forward_backward_request(msg)
        req.check_limits(limits)
        return req.model_copy(update={"adapter": model.adapter})

    return _in_order(
        request, model, msg.seq_id, hashlib.sha256(body).hexdigest(),
        OperationKind.FORWARD_BACKWARD, native,
        lambda r: convert.forward_backward_output(ForwardBackwardResult.model_validate(r)),
        nbytes=len(body),
    )  # fmt: skip


@router.post("/optim_step")
@access(Access.TINKER)
async def optim_step(request: Request) -> dict[str, Any]:
    req, fp, model = await _model_call(request, OptimStep)
    p = req.adam_params or req.optimizer_params or AdamParams()

    def native() -> OptimStepRequest:
        if p.type != "adamw":
            raise InvalidRequestError(f"optim_params: trainctl runs AdamW, not {p.type!r}")
        return OptimStepRequest(
            lr=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
            weight_decay=p.weight_decay, clip_grad=p.grad_clip_norm, adapter=model.adapter,
        )  # fmt: skip

    return _in_order(
        request, model, req.seq_id, fp, OperationKind.OPTIM_STEP, native,
        lambda r: convert.optim_step_output(StepResult.model_validate(r)),
    )  # fmt: skip


@router.post("/save_weights")
@access(Access.TINKER)
async def save_weights(request: Request) -> dict[str, Any]:
    req, fp, model = await _model_call(request, SaveWeights)
    name = req.path or f"{model.model_id.replace(':', '-')}-{req.seq_id:06d}"
    path = convert.TinkerPath(model.model_id, "weights", name)
    return _in_order(
        request, model, req.seq_id, fp, OperationKind.SAVE_CHECKPOINT,
        # The model's own names; a LoRA model's state is its adapter's alone.
        lambda: SaveCheckpointRequest(
            name=name, overwrite=req.overwrite, adapter=model.adapter,
            owner=model.native,
        ),
        lambda _: {"path": str(path), "type": "save_weights"},
    )  # fmt: skip


@router.post("/save_weights_for_sampler")
@access(Access.TINKER)
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    req, fp, model = await _model_call(request, SaveForSampler)
    if req.path is None:  # save_weights_and_get_sampling_client: the samplers, at this step
        return _in_order(
            request, model, req.seq_id, fp, OperationKind.SYNC_WEIGHTS,
            lambda: sampling_sessions.sync_request(req, model.adapter),
            lambda r: sampling_sessions.session_for(request, req, r),
        )  # fmt: skip
    path = convert.TinkerPath(model.model_id, "sampler_weights", req.path)

    def exported(result: Any) -> dict[str, Any]:
        step = ExportResult.model_validate(result).step
        sampling_sessions.remember_path(request, str(path), req, model.adapter, step)
        return {"path": str(path), "type": "save_weights_for_sampler"}

    return _in_order(
        request, model, req.seq_id, fp, OperationKind.EXPORT_HF,
        # Tinker names replace, the model's own only; a LoRA model's sampler weights are its
        # adapter (PEFT format).
        lambda: ExportRequest(
            name=req.path, overwrite=True, adapter=model.adapter,
            owner=model.native,
        ),
        exported,
    )  # fmt: skip


@router.post("/load_weights")
@access(Access.TINKER)
async def load_weights(request: Request) -> dict[str, Any]:
    req, fp = await _json(request, LoadWeights)
    state = _state(request)
    source = convert.TinkerPath.parse(req.path)
    if source.kind != "weights":
        raise InvalidRequestError(
            f"path: {req.path!r} holds sampler weights (an HF export); load a path from save_state"
        )
    tenant = tenant_of(request)
    owner = native_name(source.model_id, tenant)  # the saver's names, in this tenant's space
    creates = False  # whether the load makes the model's adapter (a slot of the tenant's)
    if req.session_id is not None and req.model_seq_id is not None:
        # A new model from saved state: its creation is its seq_id 0. On an adapters service
        # it trains an adapter of its own, restored from the one the state holds.
        state.session(req.session_id, tenant)
        await _saved(request, owner, source.name)  # 404 now: nothing is made
        if (await get_controller(request).list_adapters()).max_adapters > 0:
            existing = state.find_model(model_id_of(req.session_id, req.model_seq_id), tenant)
            if existing is not None and existing.adapter is not None:  # a retry: it has one
                model = existing
            else:
                try:
                    async with _slots(request).room(tenant):  # a slot of the tenant's
                        model = state.add_model(req.session_id, req.model_seq_id, first_seq=0)
                        model.adapter = model.native
                        creates = True
                except ConflictError as e:  # as create_model's: the SDK retries HTTP 409s
                    return future_of(state.failed("load_weights", e, tenant))
        else:
            model = state.add_model(req.session_id, req.model_seq_id, first_seq=0)
        seq_id = 0
    elif req.model_id is not None and req.seq_id is not None:
        model, seq_id = state.model(req.model_id, tenant), req.seq_id
        try:
            await _saved(request, owner, source.name)
        except NotFoundError as e:  # its turn passes on: the model's next requests go on
            state.refuse(model, seq_id, fp, e)
            raise
    else:
        raise InvalidRequestError(
            "load_weights needs model_id and seq_id, or session_id and model_seq_id"
        )
    # A LoRA model restores its own adapter alone; a full-weight model the whole state.
    restored = None if model.adapter is None else owner
    native = LoadCheckpointRequest(
        checkpoint_id=source.name, optimizer=req.optimizer, owner=owner, adapter=restored,
        into=model.adapter,
    )  # fmt: skip
    answer = _in_order(
        request, model, seq_id, fp, OperationKind.LOAD_CHECKPOINT, lambda: native,
        lambda _: {"path": req.path, "model_id": model.model_id, "type": "load_weights"},
    )  # fmt: skip
    if creates and model.adapter is not None:
        f = state.future(answer["request_id"], tenant)
        _slots(request).pending_until(tenant, model.adapter, f.done)
    return answer


async def _saved(request: Request, owner: str, name: str) -> None:
    """A 404 unless ``owner`` has a checkpoint ``name`` (deleted, or never saved)."""
    listing = await get_controller(request).list_checkpoints(owner)
    if not any(c.checkpoint_id == name for c in listing.checkpoints):
        raise NotFoundError(
            f"path: no saved state {name!r} of this model (never saved, or deleted)",
            details={"checkpoint_id": name},
        )


@router.delete("/training_runs/{run}/checkpoints/{checkpoint_id:path}")
@access(Access.TINKER)
async def delete_checkpoint(run: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
    """``RestClient.delete_checkpoint_from_tinker_path``: one of the caller's own saved
    states (``weights/<name>``) or sampler weights (``sampler_weights/<name>``) deleted
    from disk; another tenant's is unknown here (404)."""
    path = convert.TinkerPath.parse(f"tinker://{run}/{checkpoint_id}")
    if path.kind not in ("weights", "sampler_weights"):
        raise InvalidRequestError(
            f"checkpoint_id: {checkpoint_id!r} is not weights/<name> or sampler_weights/<name>"
        )
    native = DeleteCheckpointRequest(
        checkpoint_id=path.name, owner=native_name(path.model_id, tenant_of(request)),
        export=path.kind == "sampler_weights",
    )  # fmt: skip
    kind = OperationKind.DELETE_CHECKPOINT
    await get_controller(request).run(kind, native, None, fingerprint(native))
    if native.export:
        sampling_sessions.sampling_clients(request).forget_path(str(path))
    return {}


@router.post("/retrieve_future")
@access(Access.TINKER)
async def retrieve_future(request: Request) -> Response:
    body = await _fields(request)
    f = _state(request).future(text_field(body, "request_id"), tenant_of(request))
    try:
        await asyncio.wait_for(f.done.wait(), request.app.state.tinker_long_poll_s)
    except asyncio.TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": f.id, "queue_state": "active"})
    if f.error is not None:
        return JSONResponse({"error": f.error[0], "category": f.error[1]})
    if isinstance(f.result, bytes):
        return Response(f.result, media_type="application/x-protobuf")
    return JSONResponse(f.result)


def install(app: FastAPI, order_timeout_s: float = 60.0, shares: Shares | None = None) -> None:
    """Serve the Tinker protocol on ``app``, its tables bounded by ``shares``."""
    state = app.state.tinker = TinkerState(order_timeout_s=order_timeout_s, shares=shares)
    app.state.tinker_long_poll_s = LONG_POLL_S
    app.include_router(router)
    sampling_sessions.install(app, state)
    trace_export.install(app)
    slots = app.state.tinker_adapter_slots = AdapterSlots(lambda: app.state.controller, state)
    sampling: SamplingSessions = app.state.tinker_sampling

    def release(session: Any, models: list[Model]) -> None:
        slots.release(models)
        sampling.forget_session(session.session_id)

    state.on_release = release
