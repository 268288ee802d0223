"""The SDK against the real gateway app (fake controller): typed results, typed errors."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from trainctl.api import Sequence
from trainctl.clients import (
    APIConnectionError,
    BadRequestError,
    ConflictError,
    ServiceUnavailableError,
    TrainctlClient,
)
from trainctl.clients.errors import InternalServerError, error_for

from fakes import FakeController


@pytest.fixture
def client(http: TestClient) -> TrainctlClient:
    return TrainctlClient(http_client=http)


def test_train_and_eval_return_typed_results(client: TrainctlClient, fake: FakeController) -> None:
    r = client.train_batch(
        [[1, 2, 3], {"tokens": [4, 5], "loss_mask": [0, 1]}, Sequence(tokens=[6, 7, 8])]
    )
    assert r.step == 1 and r.metrics["tokens:sum"] == 8.0
    assert client.eval_batch([[1, 2]]).step == 1
    assert fake.calls == ["train_batch", "eval_batch"]
    assert client.info().step == 1


def test_invalid_input_raises_before_sending(client: TrainctlClient, fake: FakeController) -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        client.train_batch([{"tokens": [1, 2], "loss_mask": [1]}])
    assert fake.calls == []


def test_server_side_rejection_maps_to_bad_request(client: TrainctlClient) -> None:
    with pytest.raises(BadRequestError) as e:
        client.train_batch([[1, 2, 500]])
    assert e.value.status == 422 and e.value.type == "invalid_request"
    assert "sequences[0].tokens[2]" in e.value.message


def test_conflict_and_unavailable(client: TrainctlClient, fake: FakeController) -> None:
    with pytest.raises(ConflictError):
        client.stop_memory_profile()
    fake.ready = False
    assert client.is_ready() is False


def test_status_mapping() -> None:
    assert isinstance(
        error_for(503, {"type": "not_ready", "message": "x"}), ServiceUnavailableError
    )
    assert isinstance(error_for(502, "bad gateway"), InternalServerError)


def test_connection_error_is_typed() -> None:
    with TrainctlClient("http://127.0.0.1:9", timeout=2) as c, pytest.raises(APIConnectionError):
        c.health()
    assert not TrainctlClient(http_client=httpx.Client(base_url="http://127.0.0.1:9")).is_ready()
