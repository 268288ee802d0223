"""What the sync and async clients share: request building, response parsing, retry policy.

Each client method builds a ``Call`` here (method, path, body, headers and how to parse the
answer); the two clients differ only in how they send it and how they sleep between retries.
"""

from __future__ import annotations

import random
import secrets
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeAlias, TypeVar, cast

import httpx
from pydantic import BaseModel

from trainctl.api import (
    API_VERSION,
    OPERATIONS,
    LogProbsResult,
    LossConfig,
    Operation,
    OperationKind,
    SampleRequest,
    SampleResult,
    SequenceBatch,
    TokenSequence,
    wire,
)
from trainctl.api.errors import STATUS_OF, error_from
from trainctl.api.operations import route_of

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0
"""A train step on a large batch can take minutes; connection failures still fail fast."""

SequenceLike: TypeAlias = BaseModel | TokenSequence | Mapping[str, Any] | Iterable[int]
"""A ``Sequence`` model, a ``TokenSequence``, a dict of per-token lists or arrays
(``tokens``, ``loss_mask``, ...), or a list of token ids."""
LossLike: TypeAlias = LossConfig | Mapping[str, Any] | None
Packing: TypeAlias = Literal["flat", "tree"] | None
Staleness: TypeAlias = Literal["refuse", "report"]
"""What the service does with sequences past its --max-staleness bound (``staleness`` of
``train_batch`` and ``forward_backward``): a 409, or train on them and count them."""


def to_batch(seqs: Iterable[SequenceLike] | SequenceBatch) -> SequenceBatch:
    """The columnar batch of ``seqs`` (validated here: a bad batch fails before it is sent)."""
    if isinstance(seqs, SequenceBatch):
        return seqs
    rows: list[Any] = []
    for s in seqs:
        if isinstance(s, BaseModel):
            rows.append(s.model_dump(exclude_none=True))
        elif isinstance(s, (Mapping, TokenSequence)):
            rows.append(s)
        else:
            rows.append({"tokens": [int(t) for t in cast(Iterable[int], s)]})
    return SequenceBatch.from_sequences(rows)


def path(name: str) -> str:
    return f"/{API_VERSION}/{name}"


def _url(kind: OperationKind | str, req: BaseModel) -> str:
    """Where operation ``kind`` runs ``req`` (the table's route, path fields filled in)."""
    return path(route_of(OperationKind(kind), req).lstrip("/"))


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
class Call(Generic[T]):
    """One HTTP request and how to read its answer (a ``T``)."""

    method: str
    url: str
    parse: Callable[[httpx.Response], T]
    content: bytes | None = None
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def raise_for_status(response: httpx.Response) -> None:
    """Raise the service's error class (``api/errors.py``) for a 4xx/5xx response."""
    if response.status_code < 400:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_from(response.status_code, body)


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
                "routed_experts": [c.tolist() for c in columns["routed_experts"]]
                if "routed_experts" in columns
                else None,
            }
        )
    fields, _ = wire.decode(response.content)
    return model.model_validate(fields)


def parse_bytes(response: httpx.Response) -> bytes:
    raise_for_status(response)
    return response.content


def new_traceparent() -> str:
    """A W3C ``traceparent`` that starts a trace: a random trace id and span id, sampled."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def parse_json(response: httpx.Response) -> dict[str, Any]:
    raise_for_status(response)
    value: dict[str, Any] = response.json()
    return value


def parse_text(response: httpx.Response) -> str:
    raise_for_status(response)
    return response.text


def operation_result(op: Operation) -> BaseModel:
    """A finished operation's typed result (the table's result model for its kind), or its
    error raised."""
    if op.error is not None:
        raise error_from(STATUS_OF[op.error.type], op.error.model_dump(mode="json"))
    return OPERATIONS[OperationKind(op.kind)].result.model_validate(op.result)


class Requests:
    """Builds every call of the API; both clients hold one."""

    def __init__(
        self, *, binary: bool = True, compress: bool = False, float_dtype: str = "float32"
    ):
        self.binary, self.compress, self.float_dtype = binary, compress, float_dtype

    def batch(
        self,
        kind: OperationKind | str,
        sequences: Iterable[SequenceLike] | SequenceBatch,
        *,
        loss: LossLike = None,
        expected_step: int | None = None,
        entropy: bool = False,
        packing: str | None = None,
        forward_only: bool = False,
        adapter: str | None = None,
        return_routes: bool = False,
        staleness: Staleness = "refuse",
        idempotency_key: str | None = None,
    ) -> tuple[BaseModel, dict[str, str], bytes]:
        """The validated request of a batch operation, its headers and its body."""
        spec = OPERATIONS[OperationKind(kind)]
        if not spec.batch:
            raise ValueError(f"{kind} is not a batch operation")
        fields: dict[str, Any] = {}
        if packing is not None:
            fields["packing"] = packing
        if adapter is not None:
            fields["adapter"] = adapter
        if spec.kind is OperationKind.LOGPROBS:
            fields["entropy"] = entropy
            if return_routes:
                fields["return_routes"] = True
        else:
            if loss is not None:
                cfg = loss if isinstance(loss, LossConfig) else LossConfig(**loss)
                fields["loss"] = cfg.model_dump(mode="json")
            if expected_step is not None:
                fields["expected_step"] = expected_step
            if forward_only:
                fields["forward_only"] = True
            if staleness != "refuse":
                fields["staleness"] = staleness
        batch = to_batch(sequences)
        req = spec.request(sequences=batch, **fields)
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        if self.binary:
            content = wire.encode_sequences(
                batch,
                fields,
                float_dtype=self.float_dtype,
                compress=self.compress,
            )
            headers["Content-Type"] = wire.CONTENT_TYPE
            headers["Accept"] = f"{wire.CONTENT_TYPE}, {wire.JSON_CONTENT_TYPE}"
        else:
            content = req.model_dump_json(exclude_none=True).encode()
            headers["Content-Type"] = wire.JSON_CONTENT_TYPE
        return req, headers, content

    def run(self, kind: OperationKind, result: type[M], **kwargs: Any) -> Call[M]:
        """A batch operation answered when done, as ``result``."""
        req, headers, content = self.batch(kind, **kwargs)
        return Call("POST", _url(kind, req), parse_model(result), content=content, headers=headers)

    def submit(self, kind: OperationKind | str, **kwargs: Any) -> Call[Operation]:
        """A batch operation answered at once (202) with the operation to poll."""
        req, headers, content = self.batch(kind, **kwargs)
        headers["Prefer"] = "respond-async"
        return Call(
            "POST", _url(kind, req), parse_model(Operation), content=content, headers=headers
        )

    def call(self, kind: OperationKind, result: type[M], req: BaseModel | None = None) -> Call[M]:
        """A non-batch operation (JSON body, or none) with a fresh idempotency key, reused by
        every retry of this call."""
        spec = OPERATIONS[kind]
        req = req if req is not None else spec.request()
        fields = {k: v for k, v in req.model_dump().items() if f"{{{k}}}" not in spec.path}
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        content = None
        if fields:
            content = req.model_dump_json(exclude_none=True).encode()
            headers["Content-Type"] = wire.JSON_CONTENT_TYPE
        return Call("POST", _url(kind, req), parse_model(result), content=content, headers=headers)

    def operation(self, op_id: str, wait_s: float = 0.0) -> Call[Operation]:
        return Call(
            "GET", path(f"operations/{op_id}"), parse_model(Operation), params={"wait": wait_s}
        )

    def get(self, name: str, model: type[M], **params: Any) -> Call[M]:
        """``GET /v1/{name}``; ``params`` that are not None go in its query."""
        query = {k: v for k, v in params.items() if v is not None}
        return Call("GET", path(name), parse_model(model), params=query)

    def delete(self, name: str, model: type[M], **params: Any) -> Call[M]:
        """``DELETE /v1/{name}``, with a fresh idempotency key reused by every retry;
        ``params`` that are not None go in its query."""
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        query = {k: v for k, v in params.items() if v is not None}
        return Call("DELETE", path(name), parse_model(model), headers=headers, params=query)

    def download(self, profile_id: str, name: str) -> Call[bytes]:
        return Call("GET", path(f"memory_profiles/{profile_id}/files/{name}"), parse_bytes)

    def metrics(self) -> Call[str]:
        return Call("GET", "/metrics", parse_text)

    def timeline(self, since: float | None, until: float | None) -> Call[dict[str, Any]]:
        query = {k: v for k, v in {"since": since, "until": until}.items() if v is not None}
        return Call("GET", path("timeline"), parse_json, params=query)

    def sample(self, prompts: Iterable[Iterable[int]], **params: Any) -> Call[SampleResult]:
        """``POST /v1/sample`` (JSON): validated here first, as the server will."""
        req = SampleRequest(prompts=[[int(t) for t in p] for p in prompts], **params)
        content = req.model_dump_json(exclude_none=True).encode()
        headers = {"Content-Type": wire.JSON_CONTENT_TYPE}
        return Call(
            "POST", path("sample"), parse_model(SampleResult), content=content, headers=headers
        )


def auth_headers(api_token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_token}"} if api_token else {}
