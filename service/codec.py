"""Content negotiation: JSON or the binary frame (``api/wire.py``) in and out.

A request body is read with a byte limit (413 beyond it), decoded by its Content-Type and
validated by the same pydantic model either way, so both encodings accept and reject the same
requests with the same messages. The response encoding follows the Accept header.
"""

import asyncio
import contextlib
import hashlib
from typing import Any, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from trainctl.api import (
    LogProbsResult,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
    wire,
)
from trainctl.workers import spans

M = TypeVar("M", bound=BaseModel)


class DecodedBody:
    """A validated request and the sha256 of its bytes (the idempotency fingerprint)."""

    def __init__(self, model: Any, fingerprint: str, nbytes: int) -> None:
        self.model, self.fingerprint, self.nbytes = model, fingerprint, nbytes


HEAD_BYTES = 4096
BODY_IDLE_S = 30.0
"""A body that sends nothing for this long is dropped (408)."""
BODY_TIMEOUT_S = 300.0
"""A body must have arrived whole within this long (408): a slow upload cannot hold one of
the gateway's request slots for ever."""
BODY_MIN_RATE = 64 * 1024
"""Bytes per second a body must average once ``BODY_GRACE_S`` have passed (408 below it): a
trickle of a byte now and then holds a slot for seconds, not for the whole deadline."""
BODY_GRACE_S = 10.0


async def read_body(request: Request, max_bytes: int, head: bytearray | None = None) -> bytes:
    """The whole body, within ``max_bytes`` (413) and the app's read deadlines (408).
    ``head`` receives what was read of a refused body (at most ``max_bytes``; with a declared
    length past the limit, its first chunk): enough to read which request it was. One span
    on the gateway's row (``receive``)."""
    with spans.span("receive") as current:
        body = await _read_body(request, max_bytes, head)
        current.set_attribute("bytes", len(body))
        return body


async def _read_body(request: Request, max_bytes: int, head: bytearray | None) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if head is not None:
            with contextlib.suppress(Exception):
                stream = request.stream().__aiter__()
                head += (await asyncio.wait_for(stream.__anext__(), 1.0))[:HEAD_BYTES]
        raise _too_large(int(declared), max_bytes)
    state = request.app.state
    total_s = getattr(state, "body_timeout_s", BODY_TIMEOUT_S)
    grace_s = getattr(state, "body_grace_s", BODY_GRACE_S)
    idle_s = min(BODY_IDLE_S, total_s)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + total_s
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        # By when the next byte is due: the idle and whole-body deadlines, and the rate floor
        # (``size + 1`` bytes at BODY_MIN_RATE, after the grace period).
        due = start + max(grace_s, (size + 1) / BODY_MIN_RATE)
        wait = min(idle_s, deadline - loop.time(), due - loop.time())
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(wait, 0.0))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            took = loop.time() - start
            raise RequestTimeoutError(
                f"body: {size} bytes arrived in {took:.1f} s, then nothing in time (the "
                f"gateway waits {idle_s:g} s idle, {total_s:g} s in all, and wants "
                f"{BODY_MIN_RATE // 1024} KiB/s after {grace_s:g} s); send the body at once",
                details={"received_bytes": size},
            ) from None
        size += len(chunk)
        chunks.append(chunk)
        if size > max_bytes:
            if head is not None:  # what was read anyway: a compressed body's head needs more
                head[:] = b"".join(chunks)[:max_bytes]
            raise _too_large(size, max_bytes)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"body: {size} bytes exceeds the limit of {max_bytes} bytes; split the batch "
        "or use the binary encoding",
        details={"limit_bytes": max_bytes},
    )


def media_type(header: str | None) -> str:
    return (header or wire.JSON_CONTENT_TYPE).split(";")[0].strip().lower()


async def decode_request(request: Request, model: type[M], max_bytes: int) -> DecodedBody:
    """The request body as ``model``; a ``ValidationError`` surfaces as the usual 422."""
    body = await read_body(request, max_bytes)
    kind = media_type(request.headers.get("content-type"))
    with spans.span("validate"):
        fingerprint = hashlib.sha256(body).hexdigest()
        if kind == wire.CONTENT_TYPE:
            # Arrays all the way: the frame's columns are validated vectorised, never listed.
            validated = model.model_validate(wire.decode_sequences(body, max_inflated=max_bytes))
        elif kind == wire.JSON_CONTENT_TYPE or kind.endswith("+json"):
            validated = model.model_validate_json(body or b"null")
        else:
            raise UnsupportedMediaTypeError(
                f"content-type {kind!r}: send {wire.JSON_CONTENT_TYPE} or {wire.CONTENT_TYPE}"
            )
    return DecodedBody(validated, fingerprint, len(body))


def wants_binary(request: Request) -> bool:
    return wire.CONTENT_TYPE in request.headers.get("accept", "")


def encode_response(
    request: Request, result: BaseModel, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``result`` as JSON, or as a binary frame if the caller accepts one; one span on the
    gateway's row (``answer``)."""
    with spans.span("answer"):
        return _encoded(request, result, status, headers)


def _encoded(
    request: Request, result: BaseModel, status: int, headers: dict[str, str] | None
) -> Response:
    if not wants_binary(request):
        return Response(
            result.model_dump_json(),
            status_code=status,
            media_type=wire.JSON_CONTENT_TYPE,
            headers=headers,
        )
    if isinstance(result, LogProbsResult):
        body = wire.encode_per_sequence(
            {"step": result.step, "metrics": result.metrics},
            {
                "logprobs": _floats(result.logprobs),
                "entropy": _floats(result.entropy),
                "routed_experts": _ints(result.routed_experts),
            },
        )
    else:
        body = wire.encode(result.model_dump(mode="json"), {})
    return Response(body, status_code=status, media_type=wire.CONTENT_TYPE, headers=headers)


def _floats(rows: list[list[float]] | None) -> list[Any] | None:
    import numpy as np

    return None if rows is None else [np.asarray(r, np.float32) for r in rows]


def _ints(rows: list[Any] | None) -> list[Any] | None:
    import numpy as np

    return None if rows is None else [np.asarray(r, np.int32) for r in rows]
