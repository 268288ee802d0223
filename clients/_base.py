"""What the sync and async clients share: request building, response parsing, retry policy.

Each client method builds a ``Call`` here (method, path, body, headers and how to parse the
answer); the two clients differ only in how they send it and how they sleep between retries.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import httpx
from pydantic import BaseModel

from trainctl.api import (
    API_VERSION,
    EvalBatchRequest,
    LogProbsRequest,
    LogProbsResult,
    LossConfig,
    Operation,
    Sequence,
    StepResult,
    TrainBatchRequest,
    wire,
)
from trainctl.api.errors import STATUS_OF
from trainctl.clients.errors import error_for

M = TypeVar("M", bound=BaseModel)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0
"""A train step on a large batch can take minutes; connection failures still fail fast."""

SequenceLike: TypeAlias = Sequence | Mapping[str, Any] | Iterable[int]
LossLike: TypeAlias = LossConfig | Mapping[str, Any] | None

RESULT_OF: dict[str, type[BaseModel]] = {
    "train_batch": StepResult,
    "eval_batch": StepResult,
    "logprobs": LogProbsResult,
}
REQUEST_OF: dict[str, type[BaseModel]] = {
    "train_batch": TrainBatchRequest,
    "eval_batch": EvalBatchRequest,
    "logprobs": LogProbsRequest,
}


def to_sequences(seqs: Iterable[SequenceLike]) -> list[Sequence]:
    """Accept ``Sequence`` models, dicts (``tokens``, ``loss_mask``, ...) or token lists."""
    out = []
    for s in seqs:
        if isinstance(s, Sequence):
            out.append(s)
        elif isinstance(s, Mapping):
            out.append(Sequence(**{k: _plain(v) for k, v in s.items()}))
        else:
            out.append(Sequence(tokens=[int(t) for t in s]))
    return out


def _plain(v: Any) -> Any:
    """numpy arrays (and the like) as lists, for the pydantic models."""
    return v.tolist() if hasattr(v, "tolist") else v


def path(name: str) -> str:
    return f"/{API_VERSION}/{name}"


@dataclass(frozen=True)
class RetryPolicy:
    """Retry 408, 429 and 5xx (and connection errors) with capped exponential backoff.

    Mutating calls carry an idempotency key, reused on every retry, so a retry never applies
    a step twice. A ``Retry-After`` header sets the delay when the server sends one.
    """

    max_retries: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    statuses: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504})

    def delay(self, attempt: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before retry ``attempt`` (1-based), or None to stop."""
        if attempt > self.max_retries:
            return None
        if response is not None:
            if response.status_code not in self.statuses:
                return None
            after = response.headers.get("retry-after", "")
            if after.replace(".", "", 1).isdigit():
                return min(float(after), self.max_backoff_s)
        base = min(self.backoff_s * 2.0 ** (attempt - 1), self.max_backoff_s)
        jitter: float = 0.5 + random.random() / 2  # spreads a crowd of retries
        return base * jitter


NO_RETRY = RetryPolicy(max_retries=0)


@dataclass
class Call:
    """One HTTP request and how to read its answer."""

    method: str
    url: str
    parse: Callable[[httpx.Response], Any]
    content: bytes | None = None
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def raise_for_status(response: httpx.Response) -> None:
    """The matching ``APIStatusError`` for a 4xx/5xx response."""
    if response.status_code < 400:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_for(response.status_code, body)


def parse_model(model: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        raise_for_status(response)
        return read_model(response, model)

    return parse


def read_model(response: httpx.Response, model: type[M]) -> M:
    """A 2xx body as ``model``, from JSON or from a binary frame."""
    if wire.CONTENT_TYPE not in response.headers.get("content-type", ""):
        return model.model_validate_json(response.content)
    if model is LogProbsResult:
        fields, columns = wire.decode_per_sequence(response.content)
        return model.model_validate(
            {
                **fields,
                "logprobs": [c.tolist() for c in columns["logprobs"]],
                "entropy": [c.tolist() for c in columns["entropy"]]
                if "entropy" in columns
                else None,
            }
        )
    fields, _ = wire.decode(response.content)
    return model.model_validate(fields)


def parse_bytes(response: httpx.Response) -> bytes:
    raise_for_status(response)
    return response.content


def parse_text(response: httpx.Response) -> str:
    raise_for_status(response)
    return response.text


def operation_result(op: Operation) -> Any:
    """A finished operation's typed result, or its error raised as the SDK's exception."""
    if op.error is not None:
        raise error_for(STATUS_OF[op.error.type], op.error.model_dump(mode="json"))
    model = RESULT_OF.get(op.kind)
    return model.model_validate(op.result) if model is not None else op.result


class Requests:
    """Builds every call of the API; both clients hold one."""

    def __init__(
        self, *, binary: bool = True, compress: bool = False, float_dtype: str = "float32"
    ):
        self.binary, self.compress, self.float_dtype = binary, compress, float_dtype

    def batch(
        self,
        kind: str,
        sequences: Iterable[SequenceLike],
        *,
        loss: LossLike = None,
        expected_step: int | None = None,
        entropy: bool = False,
        idempotency_key: str | None = None,
        respond_async: bool = False,
    ) -> Call:
        """``train_batch``, ``eval_batch`` or ``logprobs``; validated here before sending."""
        fields: dict[str, Any] = {}
        if kind == "logprobs":
            fields["entropy"] = entropy
        else:
            if loss is not None:
                cfg = loss if isinstance(loss, LossConfig) else LossConfig(**loss)
                fields["loss"] = cfg.model_dump(mode="json")
            if expected_step is not None:
                fields["expected_step"] = expected_step
        req = REQUEST_OF[kind](sequences=to_sequences(sequences), **fields)
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        if respond_async:
            headers["Prefer"] = "respond-async"
        if self.binary:
            seqs = [s.model_dump(exclude_none=True) for s in req.sequences]  # type: ignore[attr-defined]
            content = wire.encode_sequences(
                seqs, fields, float_dtype=self.float_dtype, compress=self.compress
            )
            headers["Content-Type"] = wire.CONTENT_TYPE
            headers["Accept"] = f"{wire.CONTENT_TYPE}, {wire.JSON_CONTENT_TYPE}"
        else:
            content = req.model_dump_json(exclude_none=True).encode()
            headers["Content-Type"] = wire.JSON_CONTENT_TYPE
        parse = parse_model(Operation) if respond_async else parse_model(RESULT_OF[kind])
        return Call("POST", path(kind), parse, content=content, headers=headers)

    def operation(self, op_id: str, wait_s: float = 0.0) -> Call:
        return Call(
            "GET", path(f"operations/{op_id}"), parse_model(Operation), params={"wait": wait_s}
        )

    def get(self, name: str, model: type[M]) -> Call:
        return Call("GET", path(name), parse_model(model))

    def post_json(
        self, name: str, model: type[M], body: BaseModel | None = None, *, idempotent: bool = False
    ) -> Call:
        """A POST with an optional JSON body; ``idempotent`` adds a fresh idempotency key,
        reused by every retry of this call."""
        content = body.model_dump_json().encode() if body is not None else None
        headers = {"Content-Type": wire.JSON_CONTENT_TYPE} if body is not None else {}
        if idempotent:
            headers["Idempotency-Key"] = uuid.uuid4().hex
        return Call("POST", path(name), parse_model(model), content=content, headers=headers)

    def download(self, profile_id: str, name: str) -> Call:
        return Call("GET", path(f"memory_profiles/{profile_id}/files/{name}"), parse_bytes)

    def metrics(self) -> Call:
        return Call("GET", "/metrics", parse_text)


def auth_headers(api_token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_token}"} if api_token else {}
