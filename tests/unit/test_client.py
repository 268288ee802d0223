"""The SDK against the real gateway app (fake controller): typed results, typed errors."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from trainctl.api import Sequence
from trainctl.api.errors import ServerError, error_from
from trainctl.clients import (
    APIConnectionError,
    AsyncTrainctlClient,
    ConflictError,
    InvalidRequestError,
    NotReadyError,
    RetryPolicy,
    TrainctlClient,
)

from helpers.fakes import FakeController


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
    with pytest.raises(InvalidRequestError) as e:
        client.train_batch([[1, 2, 500]])
    assert e.value.status == 422 and e.value.type == "invalid_request"
    assert "sequences[0].tokens[2]" in e.value.message


def test_conflict_and_unavailable(client: TrainctlClient, fake: FakeController) -> None:
    with pytest.raises(ConflictError):
        client.stop_memory_profile()
    fake.ready = False
    assert client.is_ready() is False


def test_status_mapping() -> None:
    assert isinstance(error_from(503, {"type": "not_ready", "message": "x"}), NotReadyError)
    assert isinstance(error_from(502, "bad gateway"), ServerError)


def test_connection_error_is_typed() -> None:
    fast = RetryPolicy(max_retries=1, backoff_s=0.01)
    with (
        TrainctlClient("http://127.0.0.1:9", timeout=2, retry=fast) as c,
        pytest.raises(APIConnectionError),
    ):
        c.health()
    assert not TrainctlClient(http_client=httpx.Client(base_url="http://127.0.0.1:9")).is_ready()


STEP = {"loss": 1.0, "step": 1, "metrics": {}, "timings": {}}


def _flaky(statuses: list[int], seen: list[httpx.Request]) -> httpx.MockTransport:
    """Answers ``statuses`` in turn (then 200 with a step result), recording each request."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses.pop(0) if statuses else 200
        if status == 200:
            return httpx.Response(200, json=STEP)
        body = {"type": "not_ready", "message": "recovering", "details": None}
        return httpx.Response(status, json=body, headers={"Retry-After": "0"})

    return httpx.MockTransport(handler)


def test_retries_5xx_and_429_reusing_the_idempotency_key() -> None:
    seen: list[httpx.Request] = []
    http = httpx.Client(base_url="http://t", transport=_flaky([503, 429, 500], seen))
    with TrainctlClient(http_client=http, retry=RetryPolicy(backoff_s=0.001)) as c:
        assert c.train_batch([[1, 2, 3]]).step == 1
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(seen) == 4 and len(keys) == 1


def test_gives_up_after_max_retries_and_never_retries_4xx() -> None:
    seen: list[httpx.Request] = []
    http = httpx.Client(base_url="http://t", transport=_flaky([503] * 10, seen))
    policy = RetryPolicy(max_retries=2, backoff_s=0.001)
    with (
        TrainctlClient(http_client=http, retry=policy) as c,
        pytest.raises(NotReadyError),
    ):
        c.train_batch([[1, 2, 3]])
    assert len(seen) == 3
    seen.clear()
    http = httpx.Client(base_url="http://t", transport=_flaky([409], seen))
    with TrainctlClient(http_client=http) as c, pytest.raises(ConflictError):
        c.train_batch([[1, 2, 3]])
    assert len(seen) == 1


def test_the_sdk_sends_binary_by_default_and_json_on_request(fake: FakeController) -> None:
    from trainctl.service.app import create_app

    with TestClient(create_app(fake)) as http:
        seen: list[str] = []
        http.event_hooks["request"] = [lambda r: seen.append(r.headers.get("content-type", ""))]
        binary, plain = (
            TrainctlClient(http_client=http),
            TrainctlClient(http_client=http, binary=False),
        )
        batch = [{"tokens": [1, 2, 3], "weights": [1.0, 0.5, 0.25]}, [4, 5]]
        assert binary.eval_batch(batch) == plain.eval_batch(batch)
        lp, want = binary.logprobs(batch, entropy=True), plain.logprobs(batch, entropy=True)
        assert lp.entropy == want.entropy and lp.step == want.step
        for got, exp in zip(lp.logprobs, want.logprobs, strict=True):
            assert got == pytest.approx(exp, rel=1e-6)  # float32 on the wire
    assert seen[0] == "application/vnd.trainctl.tensors" and seen[1] == "application/json"


def test_async_client_mirrors_the_sync_one(fake: FakeController) -> None:
    import asyncio

    from trainctl.service.app import create_app

    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(fake))
        http = httpx.AsyncClient(transport=transport, base_url="http://t")
        async with AsyncTrainctlClient(http_client=http) as c:
            assert (await c.train_batch([[1, 2, 3]])).step == 1
            op = await c.submit("train_batch", [[1, 2, 3]], expected_step=1)
            updates: list[str] = []
            result = await c.wait(op, on_update=lambda o: updates.append(o.status.value))
            assert result.step == 2 and updates[-1] == "done"
            lp = await c.logprobs([[1, 2]])
            assert lp.logprobs[0] == pytest.approx([0.0, -0.02], rel=1e-6)
            with pytest.raises(ConflictError):
                await c.train_batch([[1, 2, 3]], expected_step=0)
            assert (await c.info()).step == 2

    asyncio.run(main())


def test_the_async_client_is_generated_from_the_sync_one() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "unasync.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_columnar_batch_is_sent_as_is(client: TrainctlClient, fake: FakeController) -> None:
    """Columns in, columns at the controller: no per-sequence objects on the way."""
    import numpy as np

    from trainctl.api import SequenceBatch

    tokens = np.arange(1, 8, dtype=np.int32)
    batch = SequenceBatch(np.array([3, 4]), {"tokens": tokens, "weights": np.full(7, 0.5)})
    assert client.train_batch(batch).metrics["tokens:sum"] == 7.0
    (got,) = fake.requests
    assert isinstance(got.sequences, SequenceBatch)
    assert got.sequences == [
        {"tokens": [1, 2, 3], "weights": [0.5] * 3},
        {"tokens": [4, 5, 6, 7], "weights": [0.5] * 4},
    ]


def test_a_misspelt_field_is_refused_by_name(client: TrainctlClient, fake: FakeController) -> None:
    with pytest.raises(InvalidRequestError, match=r"sequences\[1\]\.advantage: Extra inputs"):
        client.train_batch([[1, 2, 3], {"tokens": [4, 5], "advantage": [0.0, 1.0]}])
    with pytest.raises(InvalidRequestError, match=r"sequences\[0\]\.tokens: Field required"):
        client.eval_batch([{"loss_mask": [0, 1]}])
    assert fake.calls == []


def test_a_mask_that_is_not_0_or_1_is_refused_not_narrowed(
    client: TrainctlClient, fake: FakeController
) -> None:
    """A list mask reaches uint8 only after its values are checked: 256 is not read as 0."""
    with pytest.raises(InvalidRequestError, match=r"sequences\[0\]\.loss_mask\[1\]: .* got 256"):
        client.train_batch([{"tokens": [1, 2, 3], "loss_mask": [0, 256, 1]}])
    with pytest.raises(InvalidRequestError, match="loss_mask: must be integers, got float64"):
        client.train_batch([{"tokens": [1, 2, 3], "loss_mask": [0, 0.5, 1]}])
    assert fake.calls == []
