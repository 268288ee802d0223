"""Tinker's sampling clients on trainctl's samplers.

A sampling session is pinned to the weights of one optimizer step, the step its weights
were saved at (``save_weights_and_get_sampling_client``, a ``save_weights_for_sampler``
path, a ``save_state`` path, or the base model: step 0). trainctl's samplers keep a window
of versions (``--sampler-versions``: the newest K syncs), so a ``snapshot`` client made at
step k samples exactly step k while training moves on, for as long as k is in the window;
past it, it is **refused** with a 410 that names k and the oldest step served (Tinker
category ``user``), never answered with other weights. An ``inflight`` client samples the
newest version, which is step k or newer. A restart forgets every sampling client and empties
the window: a client made before it gets a 410 saying so (session ids carry the gateway's
start, ``TinkerState.epoch``), an id this start never issued a 404.

A LoRA model's session samples with its adapter (on a service with ``--max-adapters``): the
step is the adapter's, and the samplers serve each adapter's newest synced step.

``asample`` answers a future at once; its result is Tinker's ``SampleResponse`` protobuf.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field, ValidationInfo, field_validator

from trainctl.api import (
    ConflictError,
    GoneError,
    InvalidRequestError,
    NotFoundError,
    SampleRequest,
    SampleResult,
    Served,
    SyncResult,
    SyncWeightsRequest,
)
from trainctl.api.bounds import MAX_SEED, Int64
from trainctl.api.loss import UNPUBLISHED_LOSSES
from trainctl.api.sampling import MAX_SAMPLES_PER_PROMPT, Seed, Temperature, TopK, TopP
from trainctl.service.auth import Access, access, tenant_of
from trainctl.service.codec import read_body
from trainctl.service.routes.deps import get_controller, get_limits
from trainctl.service.tinker import proto
from trainctl.service.tinker.bodies import Body, SaveForSampler, json_object, validated
from trainctl.service.tinker.convert import TinkerPath
from trainctl.service.tinker.native import future_of
from trainctl.service.tinker.sampling_table import (
    Expiry,
    PinnedWeights,
    SamplingSession,
    SamplingSessions,
)
from trainctl.service.tinker.state import TinkerState, native_name

STOP_REASON = {"stop": 0, "length": 1}
"""Tinker's ``StopReason`` enum; vLLM's 'abort' never reaches a finished result."""


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: Int64
    base_model: str | None = None
    model_path: str | None = None


class TinkerSamplingParams(Body):
    """Tinker's sampling parameters, held to the bounds of trainctl's own (``Seed``,
    ``Temperature``, ...): a 422 names ``sampling_params.<field>``."""

    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    seed: Seed | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: Temperature = 1.0
    top_k: TopK = -1
    top_p: TopP = 1.0


class AsampleRequest(Body):
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    prompt: dict[str, Any]
    sampling_params: TinkerSamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Int64 = 0
    topk_sample_logprobs: Int64 = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: Int64 = 0
    prompt_logprobs_last_n: Int64 | None = None
    record_stability_info: bool | None = None

    @field_validator("sampling_params")
    @classmethod
    def _seed_room(cls, p: TinkerSamplingParams, info: ValidationInfo) -> TinkerSamplingParams:
        n = info.data.get("num_samples", 1)
        if p.seed is not None and p.seed + n - 1 > MAX_SEED:
            raise ValueError(
                f"seed: the sampler seeds sample i with seed + i, so with num_samples = {n} "
                f"the seed is at most 2^64 - {n}"
            )
        return p


def sync_request(req: SaveForSampler, adapter: str | None) -> SyncWeightsRequest:
    """``save_weights_and_get_sampling_client``: bring the samplers to the current step (of
    the model's adapter, for a LoRA model)."""
    if req.sampling_session_seq_id is None:
        raise InvalidRequestError(
            "path: name the weights, or give sampling_session_seq_id for a sampling client"
        )
    if req.kind not in ("snapshot", "inflight"):
        raise InvalidRequestError(f"kind: 'snapshot' or 'inflight', not {req.kind!r}")
    return SyncWeightsRequest(adapter=adapter)


def session_for(request: Request, req: SaveForSampler, result: Any) -> dict[str, Any]:
    """The sampling session of a finished sync: pinned at the step it synced."""
    synced = SyncResult.model_validate(result)
    model_id = req.model_id
    s = sampling_clients(request).add(
        SamplingSession(
            sampling_session_id=f"{model_id}:sample:{req.sampling_session_seq_id}",
            base_model="",  # the served model's name, read when asked (get_sampler)
            model_path=None,
            step=synced.step,
            adapter=synced.adapter,
            inflight=req.kind == "inflight",
            expiry=Expiry.after(req.ttl_seconds),
            tenant=tenant_of(request),
        )
    )
    return {"type": "save_weights_for_sampler", "sampling_session_id": s.sampling_session_id}


def remember_path(
    request: Request, path: str, req: SaveForSampler, adapter: str | None, step: int
) -> None:
    weights = PinnedWeights(adapter, step, Expiry.after(req.ttl_seconds), tenant_of(request))
    sampling_clients(request).remember_path(path, weights)


def sampling_clients(request: Request) -> SamplingSessions:
    """This app's table of sampling clients and sampler paths."""
    value: SamplingSessions = request.app.state.tinker_sampling
    return value


async def _pinned(
    request: Request, info: Served, model_path: str | None, base_model: str | None
) -> PinnedWeights:
    """The adapter (None: the base), step and expiry of the weights a sampling client asks
    for; 404/422 if there are none, 410 if they expired."""
    if model_path is None:
        _need_samplers(info)
        if base_model != info.model_name:
            raise InvalidRequestError(
                f"base_model: this service serves {info.model_name!r}, not {base_model!r}"
            )
        return PinnedWeights(None, 0)
    path = TinkerPath.parse(model_path, "model_path")
    if path.kind == "sampler_weights":  # a path of someone else's is unknown (404) first
        pinned = sampling_clients(request).pinned(str(path), tenant_of(request))
        _need_samplers(info)
        return pinned
    _need_samplers(info)
    if path.kind == "weights":
        if (await get_controller(request).list_adapters()).max_adapters:
            raise InvalidRequestError(
                f"model_path: {model_path!r} is a training state; on a LoRA service sample "
                "a LoRA model from save_weights_for_sampler's path, or with "
                "save_weights_and_get_sampling_client"
            )
        owner = native_name(path.model_id, tenant_of(request))  # whose names: its saver's
        for c in (await get_controller(request).list_checkpoints(owner)).checkpoints:
            if c.checkpoint_id == path.name:
                return PinnedWeights(None, c.step)
        raise NotFoundError(f"model_path: no checkpoint {path.name!r}")
    raise InvalidRequestError(f"model_path: {model_path!r} names no weights")


def _need_samplers(info: Served) -> None:
    if info.samplers is None:
        raise ConflictError(
            "this service has no samplers: start it with --samplers N to sample through Tinker"
        )


def _check_served(step: int, adapter: str | None, info: Served) -> None:
    """A 410 if the samplers' window no longer holds ``step`` (404: the adapter, at all)."""
    samplers = info.samplers
    if samplers is None:
        return
    served = samplers.versions
    if adapter is not None:
        served = samplers.adapter_versions.get(adapter, [])
        if not served:
            raise NotFoundError(
                f"model_path: the samplers serve no adapter {adapter!r} (deleted, or never "
                "synced); save_weights_and_get_sampling_client syncs it"
            )
    if served and step not in served and step < served[-1]:
        raise GoneError(_gone(step, served[0], samplers.window), details={"served": served})


def _gone(step: int, oldest: int, window: int) -> str:
    return (
        f"this sampling client samples the weights of step {step}, which have left the "
        f"samplers' window of {window} versions (--sampler-versions {window}; the oldest "
        f"served is step {oldest}): make a new sampling client "
        "(save_weights_and_get_sampling_client), or start the service with a larger "
        "--sampler-versions to keep more steps servable"
    )


@contextlib.asynccontextmanager
async def _in_tinker_words(step: int) -> AsyncIterator[None]:
    """A 410 of the samplers' window, said to a sampling client pinned to ``step``."""
    try:
        yield
    except GoneError as e:
        details = e.details or {}
        served = details.get("served") or [step]
        size = details.get("window", len(served))
        raise GoneError(_gone(step, served[0], size), details=e.details) from None


def _stale(step: int, served: int) -> str:
    return (
        f"this inflight sampling client samples step {step} or newer, and the samplers serve "
        f"step {served}: make a new sampling client (save_weights_and_get_sampling_client)"
    )


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise InvalidRequestError("prompt.chunks: a non-empty list of chunks is required")
    tokens: list[int] = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            kind = c.get("type") if isinstance(c, dict) else type(c).__name__
            raise InvalidRequestError(
                f"prompt.chunks[{i}]: trainctl samples text tokens only, not {kind!r}"
            )
        got = c.get("tokens")
        if not isinstance(got, list) or not all(type(t) is int for t in got):
            raise InvalidRequestError(f"prompt.chunks[{i}].tokens: a list of token ids")
        tokens += got
    return tokens


def native_request(
    req: AsampleRequest, step: int | None, adapter: str | None = None
) -> SampleRequest:
    """Tinker's sample request as trainctl's; what is not supported is refused by name."""
    unsupported = {
        "topk_prompt_logprobs": req.topk_prompt_logprobs,
        "topk_sample_logprobs": req.topk_sample_logprobs,
        "target_prompt_logprobs": req.target_prompt_logprobs,
        "prompt_alt_tokens_k": req.prompt_alt_tokens_k,
        "prompt_logprobs_last_n": req.prompt_logprobs_last_n,
    }
    if req.record_stability_info:
        raise InvalidRequestError(
            "record_stability_info: only the stable_reinforce loss reads it, and trainctl "
            f"does not compute stable_reinforce: {UNPUBLISHED_LOSSES['stable_reinforce']}; "
            "train with loss_fn='gspo' or 'importance_sampling' and sample without "
            "record_stability_info",
            details={"field": "record_stability_info"},
        )
    for name, value in unsupported.items():
        if value:
            raise InvalidRequestError(f"{name}: not supported by trainctl's samplers")
    p = req.sampling_params
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    ids = [int(t) for t in stop if type(t) is int]
    strings = [t for t in stop if isinstance(t, str)]
    if ids and strings:
        raise InvalidRequestError(
            "sampling_params.stop: give strings or token ids, not both in one list"
        )
    extra = {} if p.max_tokens is None else {"max_tokens": p.max_tokens}
    return SampleRequest(
        prompts=[_prompt_tokens(req.prompt)],
        n=req.num_samples,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop_token_ids=ids,
        stop=strings,
        logprobs=True,
        prompt_logprobs=bool(req.prompt_logprobs),
        step=step,
        adapter=adapter,
        **extra,
    )


def sample_response(result: SampleResult) -> bytes:
    """trainctl's result for one prompt as Tinker's ``SampleResponse`` protobuf."""
    (samples,) = result.samples
    msg = proto.SampleResponse()
    for c in samples.completions:
        seq = msg.sequences.add()
        seq.stop_reason = STOP_REASON["stop" if c.finish_reason == "stop" else "length"]
        seq.tokens = np.asarray(c.tokens, np.int32).tobytes()
        if c.logprobs is not None:
            seq.logprobs = np.asarray(c.logprobs, np.float32).tobytes()
    if samples.prompt_logprobs is not None:
        lps = [np.nan if x is None else x for x in samples.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(lps, np.float32).tobytes()
    out: bytes = msg.SerializeToString()
    return out


router = APIRouter(prefix="/api/v1", include_in_schema=False)


@router.post("/create_sampling_session")
@access(Access.TINKER)
async def create_sampling_session(request: Request) -> dict[str, Any]:
    raw = json_object(await read_body(request, 1 << 16))
    req, _ = validated(raw, CreateSamplingSession)
    state: TinkerState = request.app.state.tinker
    state.session(req.session_id, tenant_of(request))
    info = await get_controller(request).served()
    pinned = await _pinned(request, info, req.model_path, req.base_model)
    _check_served(pinned.step, pinned.adapter, info)
    s = sampling_clients(request).add(
        SamplingSession(
            sampling_session_id=f"{req.session_id}:sample:{req.sampling_session_seq_id}",
            base_model=info.model_name,
            model_path=req.model_path,
            step=pinned.step,
            adapter=pinned.adapter,
            expiry=pinned.expiry,
            tenant=tenant_of(request),
        )
    )
    return {"type": "create_sampling_session", "sampling_session_id": s.sampling_session_id}


@router.get("/samplers/{sampler_id}")
@access(Access.TINKER)
async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
    s = sampling_clients(request).get(sampler_id, tenant_of(request))
    base_model = s.base_model or (await get_controller(request).served()).model_name
    return {"sampler_id": s.sampling_session_id, "base_model": base_model,
            "model_path": s.model_path}  # fmt: skip


@router.post("/asample")
@access(Access.TINKER)
async def asample(request: Request) -> dict[str, Any]:
    raw = json_object(await read_body(request, request.app.state.max_body_bytes))
    req, _ = validated(raw, AsampleRequest)
    inflight = False
    if req.sampling_session_id is not None:
        session = sampling_clients(request).get(req.sampling_session_id, tenant_of(request))
        adapter, step, inflight = session.adapter, session.step, session.inflight
        tinker_state: TinkerState = request.app.state.tinker
        tinker_state.traced(req.sampling_session_id.split(":", 1)[0])
    else:
        info = await get_controller(request).served()
        pinned = await _pinned(request, info, req.model_path, req.base_model)
        adapter, step = pinned.adapter, pinned.step
    native = native_request(req, None if inflight else step, adapter)
    native.check_limits(await get_limits(request, get_controller(request)))
    controller = get_controller(request)
    # Past the samplers' bound, a 429 now (the SDK retries it) rather than a future that
    # waits; past the window, a 410 now.
    async with _in_tinker_words(step):
        await controller.check_sample_room(native)

    async def work() -> bytes:
        # The client holds a future already: if the samplers filled up since the check
        # above, it waits for room and for its turn.
        async with _in_tinker_words(step):
            result = await controller.sample(native, True)
        if result.step < step:  # inflight: this step or newer, never older
            raise ConflictError(_stale(step, result.step), details={"step": result.step})
        return sample_response(result)

    state: TinkerState = request.app.state.tinker
    f = state.sample(work, tenant_of(request))  # 429 past the tenant's share in flight
    ids = [f"{f.id}:{i}" for i in range(native.n)]
    return {**future_of(f), "sample_sequence_ids": ids}


def install(app: Any, state: TinkerState) -> None:
    app.state.tinker_sampling = SamplingSessions(
        state.evicted, state.shares, issued_before=state.issued_before_this_start,
        finished=state.finish_reason,
    )  # fmt: skip
    app.include_router(router)
