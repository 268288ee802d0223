"""Request building and response parsing shared by the sync (and later async) clients."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias, TypeVar

import httpx
from pydantic import BaseModel

from trainctl.api import API_VERSION, Sequence
from trainctl.clients.errors import error_for

T = TypeVar("T", bound=BaseModel)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0
"""A train step on a large batch can take minutes; connection failures still fail fast."""

SequenceLike: TypeAlias = Sequence | Mapping[str, Any] | Iterable[int]


def to_sequences(seqs: Iterable[SequenceLike]) -> list[Sequence]:
    """Accept ``Sequence`` models, dicts (``tokens``, ``loss_mask``, ``weights``) or token lists."""
    out = []
    for s in seqs:
        if isinstance(s, Sequence):
            out.append(s)
        elif isinstance(s, Mapping):
            out.append(Sequence(**s))
        else:
            out.append(Sequence(tokens=[int(t) for t in s]))
    return out


def path(name: str) -> str:
    return f"/{API_VERSION}/{name}"


def parse(response: httpx.Response, model: type[T]) -> T:
    """The typed body of a 2xx response, or the matching ``APIStatusError``."""
    if response.status_code >= 400:
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        raise error_for(response.status_code, body)
    return model.model_validate(response.json())
