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
"""

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from trainctl.api import (
    ErrorBody,
    ExportRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    Info,
    InvalidRequestError,
    LoadCheckpointRequest,
    OperationKind,
    OptimStepRequest,
    PayloadTooLargeError,
    SaveCheckpointRequest,
    StepResult,
    TrainctlError,
)
from trainctl.api.errors import STATUS_OF, error_from
from trainctl.service.auth import Access, access
from trainctl.service.codec import HEAD_BYTES, read_body
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.routes.deps import get_limits
from trainctl.service.tinker import convert, proto
from trainctl.service.tinker.bodies import (
    AdamParams,
    Body,
    CreateModelRequest,
    LoadWeights,
    ModelCall,
    OptimStep,
    SaveForSampler,
    SaveWeights,
    check_create_model,
)
from trainctl.service.tinker.state import Future, Model, TinkerState, model_id_of

PREFIX = "/api/v1"
LONG_POLL_S = 30.0
"""``retrieve_future`` waits this long before ``try_again`` (the SDK's read timeout is 45 s)."""
OPERATION_WAIT_S = 30.0


def _state(request: Request) -> TinkerState:
    return request.app.state.tinker  # type: ignore[no-any-return]


def _controller(request: Request) -> ControllerAPI:
    return request.app.state.controller  # type: ignore[no-any-return]


def _object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object, or a 422 saying what it is instead."""
    try:
        raw = json.loads(body or b"{}")
    except ValueError as e:
        raise InvalidRequestError(f"body: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"body: a JSON object is expected, not {type(raw).__name__}")
    return raw


def _validated(raw: dict[str, Any], model: type[Body]) -> tuple[Any, str]:
    """``raw`` as ``model`` and its fingerprint (sha256 of the canonical JSON)."""
    req = model.model_validate(raw)
    return req, hashlib.sha256(req.model_dump_json().encode()).hexdigest()


async def _json(request: Request, model: type[Body]) -> tuple[Any, str]:
    """The body as ``model`` and its fingerprint."""
    return _validated(_object(await read_body(request, request.app.state.max_body_bytes)), model)


async def _model_call(request: Request, model: type[ModelCall]) -> tuple[Any, str, Model]:
    """The body, its fingerprint and the model handle it names. A body refused after its
    model and ``seq_id`` are known passes that ``seq_id``'s turn on, so the model's later
    requests do not wait for it."""
    raw = _object(await read_body(request, request.app.state.max_body_bytes))
    try:
        req, fp = _validated(raw, model)
    except ValidationError as e:
        state, model_id, seq_id = _state(request), raw.get("model_id"), raw.get("seq_id")
        if isinstance(model_id, str) and type(seq_id) is int and model_id in state.models:
            state.refuse(state.models[model_id], seq_id, "refused", e)
        raise
    return req, fp, _state(request).model(req.model_id)


async def _fields(request: Request) -> dict[str, Any]:
    """A small JSON body read as a plain object (the calls that name one id)."""
    return _object(await read_body(request, 1 << 16))


def _text(body: dict[str, Any], name: str) -> str:
    """``body[name]`` as a string, or a 422 naming it."""
    value = body.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name}: a string is required")
    return value


def _future(f: Future, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": f.id, "model_id": model_id}


async def _info(request: Request) -> Info:
    return await _controller(request).info()


async def _run_op(controller: ControllerAPI, op_id: str) -> Any:
    """Wait for a native operation; its result, or its error raised."""
    while True:
        op = await controller.operation(op_id, OPERATION_WAIT_S)
        if op.finished:
            break
    if op.error is not None:
        raise _op_error(op.error)
    return op.result


def _op_error(body: ErrorBody) -> TrainctlError:
    return error_from(STATUS_OF[body.type], body.model_dump(mode="json"))


def _in_order(
    request: Request,
    model: Model,
    seq_id: int,
    fingerprint: str,
    kind: OperationKind,
    native: Callable[[], BaseModel],
    result_of: Callable[[Any], Any],
    nbytes: int = 0,
) -> dict[str, Any]:
    """Queue the native request ``native()`` makes in ``model``'s ``seq_id`` order,
    idempotent under its key; the future of its converted result. ``native`` runs in the
    request's turn, so a request it refuses fails its future and passes the turn on."""
    controller = _controller(request)

    async def admit() -> Awaitable[Any]:
        op = await controller.submit(kind, native(), _key(model, seq_id), fingerprint)

        async def finish() -> Any:
            return result_of(await _run_op(controller, op.id))

        return finish()

    f = _state(request).submit(model, seq_id, fingerprint, kind.value, admit, nbytes)
    return _future(f, model.model_id)


def build_router() -> APIRouter:
    r = APIRouter(prefix=PREFIX, include_in_schema=False)

    @r.post("/client/dynamic_config")
    @access(Access.OPEN)
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @r.post("/client/config")
    @access(Access.TINKER)
    async def client_config() -> dict[str, Any]:
        # protobuf forward_backward bodies, zstd-compressed; no JWT exchange
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True}

    @r.post("/create_session")
    @access(Access.TINKER)
    async def create_session(request: Request) -> dict[str, Any]:
        session_id = _state(request).create_session()
        return {"type": "create_session", "session_id": session_id}

    @r.post("/session_heartbeat")
    @access(Access.TINKER)
    async def session_heartbeat(request: Request) -> Response:
        body = await _fields(request)
        s = _state(request).session(_text(body, "session_id"))
        if s.finished is not None:
            return JSONResponse({"detail": f"session finished: {s.finished}"}, status_code=410)
        return JSONResponse({"type": "session_heartbeat"})

    @r.post("/sessions/{session_id}/finish")
    @access(Access.TINKER)
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        body = await _fields(request)
        s = _state(request).session(session_id)
        if s.finished is None:  # first wins
            reason = body.get("reason")
            s.finished = (
                str(reason.get("type", "success")) if isinstance(reason, dict) else "success"
            )
        return {}

    @r.get("/healthz")
    @access(Access.OPEN)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @r.get("/get_server_capabilities")
    @access(Access.TINKER)
    async def get_server_capabilities(request: Request) -> dict[str, Any]:
        info = await _info(request)
        model = {
            "model_name": info.model_name,
            "max_context_length": info.limits.max_seq_len - 1,  # the input, then one target
            "trainable": True,
            "sampleable": False,
        }
        return {"supported_models": [model]}

    @r.post("/telemetry")
    @access(Access.TINKER)
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped

    @r.post("/create_model")
    @access(Access.TINKER)
    async def create_model(request: Request) -> dict[str, Any]:
        req, fp = await _json(request, CreateModelRequest)
        state = _state(request)
        state.session(req.session_id)
        model_id = model_id_of(req.session_id, req.model_seq_id)

        async def create() -> dict[str, Any]:
            info = await _info(request)
            check_create_model(req, info)
            state.add_model(req.session_id, req.model_seq_id)
            return {"model_id": model_id, "type": "create_model"}

        key = (req.session_id, req.model_seq_id)
        f = state.once(state.created, key, fp, lambda: state.run("create_model", create))
        return _future(f, model_id)

    @r.post("/get_info")
    @access(Access.TINKER)
    async def get_info(request: Request) -> dict[str, Any]:
        body = await _fields(request)
        model = _state(request).model(_text(body, "model_id"))
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
            "is_lora": False,
            "lora_rank": None,
            "optimizer_config": {"type": "adamw"},
        }

    @r.post("/forward_backward")
    @access(Access.TINKER)
    async def forward_backward(request: Request) -> dict[str, Any]:
        zstd = "zstd" in request.headers.get("content-encoding", "").lower()
        head = bytearray()  # the body's start, or (zstd) the whole compressed body once read
        try:
            body = await read_body(request, request.app.state.max_body_bytes, head)
            if zstd:
                head = bytearray(body)
                body = await asyncio.to_thread(_unzstd, body, request.app.state.max_body_bytes)
        except PayloadTooLargeError as e:
            # Its seq_id's turn passes on: the model's next request must not wait for it.
            ids = _leading_ids(_unzstd_head(bytes(head)) if zstd else bytes(head))
            state = _state(request)
            if ids is not None and ids[0] in state.models:
                state.refuse(state.models[ids[0]], ids[1], "refused", e)
            raise
        msg = proto.ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except Exception as e:
            raise InvalidRequestError(f"body: not a ForwardBackwardRequest protobuf ({e})") from e
        model = _state(request).model(msg.model_id)
        limits = await get_limits(request, _controller(request))

        def native() -> ForwardBackwardRequest:
            req = convert.forward_backward_request(msg)
            req.check_limits(limits)
            return req

        return _in_order(
            request, model, msg.seq_id, hashlib.sha256(body).hexdigest(),
            OperationKind.FORWARD_BACKWARD, native,
            lambda r: convert.forward_backward_output(ForwardBackwardResult.model_validate(r)),
            nbytes=len(body),
        )  # fmt: skip

    @r.post("/optim_step")
    @access(Access.TINKER)
    async def optim_step(request: Request) -> dict[str, Any]:
        req, fp, model = await _model_call(request, OptimStep)
        p = req.adam_params or req.optimizer_params or AdamParams()

        def native() -> OptimStepRequest:
            if p.type != "adamw":
                raise InvalidRequestError(f"optim_params: trainctl runs AdamW, not {p.type!r}")
            return OptimStepRequest(
                lr=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                weight_decay=p.weight_decay, clip_grad=p.grad_clip_norm,
            )  # fmt: skip

        return _in_order(
            request, model, req.seq_id, fp, OperationKind.OPTIM_STEP, native,
            lambda r: convert.optim_step_output(StepResult.model_validate(r)),
        )  # fmt: skip

    @r.post("/save_weights")
    @access(Access.TINKER)
    async def save_weights(request: Request) -> dict[str, Any]:
        req, fp, model = await _model_call(request, SaveWeights)
        name = req.path or f"{model.model_id.replace(':', '-')}-{req.seq_id:06d}"
        path = convert.TinkerPath(model.model_id, "weights", name)
        return _in_order(
            request, model, req.seq_id, fp, OperationKind.SAVE_CHECKPOINT,
            lambda: SaveCheckpointRequest(name=name, overwrite=req.overwrite),
            lambda _: {"path": str(path), "type": "save_weights"},
        )  # fmt: skip

    @r.post("/save_weights_for_sampler")
    @access(Access.TINKER)
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        req, fp, model = await _model_call(request, SaveForSampler)
        path = convert.TinkerPath(model.model_id, "sampler_weights", req.path or "")

        def native() -> ExportRequest:
            if req.path is None:
                raise InvalidRequestError(
                    "path: trainctl trains and does not sample; name the weights "
                    "(save_weights_for_sampler(name)) to get a Hugging Face export for vLLM "
                    "or transformers"
                )
            return ExportRequest(name=req.path, overwrite=True)  # Tinker names replace

        return _in_order(
            request, model, req.seq_id, fp, OperationKind.EXPORT_HF, native,
            lambda _: {"path": str(path), "type": "save_weights_for_sampler"},
        )  # fmt: skip

    @r.post("/load_weights")
    @access(Access.TINKER)
    async def load_weights(request: Request) -> dict[str, Any]:
        req, fp = await _json(request, LoadWeights)
        state = _state(request)
        source = convert.TinkerPath.parse(req.path)
        if source.kind != "weights":
            raise InvalidRequestError(
                f"path: {req.path!r} holds sampler weights (an HF export); load a path from "
                "save_state"
            )
        native = LoadCheckpointRequest(checkpoint_id=source.name, optimizer=req.optimizer)
        if req.session_id is not None and req.model_seq_id is not None:
            # A new model from saved state: its creation is its seq_id 0.
            state.session(req.session_id)
            model, seq_id = state.add_model(req.session_id, req.model_seq_id, first_seq=0), 0
        elif req.model_id is not None and req.seq_id is not None:
            model, seq_id = state.model(req.model_id), req.seq_id
        else:
            raise InvalidRequestError(
                "load_weights needs model_id and seq_id, or session_id and model_seq_id"
            )
        return _in_order(
            request, model, seq_id, fp, OperationKind.LOAD_CHECKPOINT, lambda: native,
            lambda _: {"path": req.path, "model_id": model.model_id, "type": "load_weights"},
        )  # fmt: skip

    @r.post("/retrieve_future")
    @access(Access.TINKER)
    async def retrieve_future(request: Request) -> Response:
        body = await _fields(request)
        f = _state(request).future(_text(body, "request_id"))
        try:
            await asyncio.wait_for(f.done.wait(), request.app.state.tinker_long_poll_s)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": f.id, "queue_state": "active"})
        if f.error is not None:
            return JSONResponse({"error": f.error[0], "category": f.error[1]})
        if isinstance(f.result, bytes):
            return Response(f.result, media_type="application/x-protobuf")
        return JSONResponse(f.result)

    return r


def _key(model: Model, seq_id: int) -> str:
    """The native idempotency key of a model's request: the controller applies it once."""
    return f"tinker:{model.model_id}:{seq_id}"


def _unzstd(body: bytes, max_bytes: int) -> bytes:
    """``body`` inflated in a bounded stream: the body limit applies to the inflated size,
    whatever content size the frame states, and no more than ``max_bytes + 1`` bytes are
    ever produced."""
    import zstandard

    declared = zstandard.frame_content_size(body) if len(body) >= 18 else -1
    if declared > max_bytes:
        raise _inflates_past(max_bytes)
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as r:
            while chunk := r.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise _inflates_past(max_bytes)
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise InvalidRequestError(f"body: not valid zstd ({e})") from e
    return b"".join(out)


def _unzstd_head(body: bytes) -> bytes:
    """The first ``HEAD_BYTES`` a zstd body (or its start) inflates to; b"" if it cannot
    say. Bounded: no more is ever inflated."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as r:
            return bytes(r.read(HEAD_BYTES))
    except zstandard.ZstdError:
        return b""


def _leading_ids(buf: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` from the start of a ``ForwardBackwardRequest``: protobuf writes
    fields in number order, and these are fields 1 and 2, ahead of the data."""
    pos, model_id, seq_id = 0, None, None
    try:
        while pos < len(buf) and (model_id is None or seq_id is None):
            key, pos = _varint(buf, pos)
            if key == (1 << 3) | 2:  # model_id: length-delimited
                n, pos = _varint(buf, pos)
                model_id, pos = buf[pos : pos + n].decode(), pos + n
            elif key == (2 << 3) | 0:  # seq_id: varint
                seq_id, pos = _varint(buf, pos)
            else:
                break
    except (IndexError, UnicodeDecodeError):
        return None
    return None if model_id is None or seq_id is None else (model_id, seq_id)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        value, shift, pos = value | (b & 0x7F) << shift, shift + 7, pos + 1
        if b < 0x80 or shift > 63:
            return value, pos


def _inflates_past(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"body: the zstd payload inflates past the limit of {limit} bytes",
        details={"limit_bytes": limit},
    )


def install(app: FastAPI, order_timeout_s: float = 60.0) -> None:
    """Serve the Tinker protocol on ``app``."""
    app.state.tinker = TinkerState(order_timeout_s=order_timeout_s)
    app.state.tinker_long_poll_s = LONG_POLL_S
    app.include_router(build_router())
