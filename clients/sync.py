"""The synchronous Python client.

from trainctl.clients import TrainctlClient

with TrainctlClient("http://127.0.0.1:8000") as tc:
    result = tc.train_batch([{"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}])
    print(result.loss, result.step)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx

from trainctl.api import (
    EvalBatchRequest,
    Health,
    Info,
    LossConfig,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    StepResult,
    TrainBatchRequest,
)
from trainctl.clients._base import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT_S,
    SequenceLike,
    T,
    parse,
    path,
    to_sequences,
)
from trainctl.clients.errors import APIConnectionError, APIStatusError


def _loss(loss: LossConfig | dict[str, Any] | None) -> dict[str, Any]:
    if loss is None:
        return {}
    return {"loss": loss if isinstance(loss, LossConfig) else LossConfig(**loss)}


class TrainctlClient:
    """Blocking client of one trainctl service. Use as a context manager, or call ``close()``."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_token: str | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {api_token}"} if api_token else {}
        self._http = http_client or httpx.Client(
            base_url=base_url, timeout=timeout, headers=headers
        )

    def __enter__(self) -> TrainctlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, name: str, model: type[T], body: Any = None) -> T:
        try:
            response = self._http.request(method, path(name), json=body)
        except httpx.TransportError as e:
            raise APIConnectionError(f"{method} {path(name)}: {e}") from e
        return parse(response, model)

    def train_batch(
        self, sequences: Iterable[SequenceLike], loss: LossConfig | dict[str, Any] | None = None
    ) -> StepResult:
        """Forward/backward over ``sequences`` and one optimizer step (default loss:
        token-mean cross-entropy; see ``LossConfig`` for importance sampling and PPO)."""
        req = TrainBatchRequest(sequences=to_sequences(sequences), **_loss(loss))
        return self._request("POST", "train_batch", StepResult, req.model_dump(exclude_none=True))

    def eval_batch(
        self, sequences: Iterable[SequenceLike], loss: LossConfig | dict[str, Any] | None = None
    ) -> StepResult:
        """The loss of ``sequences`` without backward or update."""
        req = EvalBatchRequest(sequences=to_sequences(sequences), **_loss(loss))
        return self._request("POST", "eval_batch", StepResult, req.model_dump(exclude_none=True))

    def start_memory_profile(self, max_entries: int = 100_000) -> MemoryProfileStarted:
        body = MemoryProfileStartRequest(max_entries=max_entries).model_dump()
        return self._request("POST", "memory_profile/start", MemoryProfileStarted, body)

    def stop_memory_profile(self) -> MemoryProfileResult:
        return self._request("POST", "memory_profile/stop", MemoryProfileResult)

    def info(self) -> Info:
        return self._request("GET", "info", Info)

    def health(self) -> Health:
        return self._request("GET", "health", Health)

    def is_ready(self) -> bool:
        try:
            self._request("GET", "ready", Health)
        except (APIConnectionError, APIStatusError):
            return False
        return True

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until the service reports ready; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainctl not ready after {timeout:.0f}s")
            time.sleep(poll_s)
