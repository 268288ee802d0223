"""The spine end to end: real `trainctl serve` (dp=2), real Ray Serve, real HTTP, the SDK.

Tests run in file order on one service; the reference comparison runs first, at step 0.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from trainctl.clients import BadRequestError

from conftest import Service

REFERENCE = Path(__file__).parents[1] / "reference.py"


def ragged_batch(seed: int, vocab: int = 512) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (23, 7, 48, 3, 31):
        tokens = rng.integers(0, vocab, n).tolist()
        prompt = int(rng.integers(1, n))
        out.append({"tokens": tokens, "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return out


def test_info_describes_the_dp2_service(service: Service) -> None:
    info = service.client().info()
    assert info.world_size == 2 and info.layout["dp"] == 2 and info.step == 0
    assert sorted(r.coords["dp"] for r in info.ranks) == [0, 1]
    # DP replicas hold identical weights.
    assert info.ranks[0].weights_digest == info.ranks[1].weights_digest
    assert info.versions["megatron-core"] == "0.16.1"


def test_eval_equals_single_process_reference(service: Service) -> None:
    client = service.client()
    assert client.info().step == 0, "this test needs the untrained model; it must run first"
    batch = ragged_batch(seed=1)
    got = client.eval_batch(batch).loss
    ref = subprocess.run(
        [sys.executable, str(REFERENCE)],
        input=json.dumps({"sequences": batch}),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    want = json.loads(ref.stdout.strip().splitlines()[-1])["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


BAD_BODIES = [
    ({"sequences": []}, "sequences"),
    ({"sequences": [{"tokens": [1, 2, 512]}]}, "sequences[0].tokens[2]"),
    ({"sequences": [{"tokens": [1, 2, 3], "loss_mask": [1, 1]}]}, "sequences[0].loss_mask"),
    ({"sequences": [{"tokens": ["x", 1]}]}, "sequences[0].tokens[0]"),
    ({"sequences": [{"tokens": list(range(2, 2000))}]}, "sequences[0].tokens"),
    ({"sequences": [{"tokens": [1, 2], "weights": [1.0, "nan"]}]}, "sequences[0].weights"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_input_is_rejected_and_changes_nothing(
    service: Service, body: dict, field: str
) -> None:
    client = service.client()
    before = client.info()
    r = httpx.post(f"{service.url}/v1/train_batch", json=body, timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["type"] == "invalid_request" and err["message"].startswith(f"{field}:"), err
    after = client.info()
    assert (after.step, after.weights_digest) == (before.step, before.weights_digest)


def test_sdk_raises_bad_request(service: Service) -> None:
    with pytest.raises(BadRequestError, match=r"sequences\[0\]\.tokens\[1\]"):
        service.client().train_batch([[1, 99999]])


def test_five_train_batches_lower_the_loss(service: Service) -> None:
    client = service.client()
    batch = ragged_batch(seed=2)
    start = client.info().step
    results = [client.train_batch(batch) for _ in range(5)]
    losses = [r.loss for r in results]
    assert [r.step for r in results] == list(range(start + 1, start + 6))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert client.eval_batch(batch).loss < losses[-1]
    r = results[-1]
    assert r.metrics["loss:mean"] == r.loss and r.metrics["grad_norm:value"] > 0
    assert r.metrics["tokens:sum"] == sum(len(s["tokens"]) for s in batch)
    assert {"plan_s", "total_s", "forward_backward_max_s", "optimizer_max_s"} <= set(r.timings)
    info = client.info()
    assert info.step == start + 5 and info.ranks[0].weights_digest == info.ranks[1].weights_digest


def test_memory_profile_round_trip(service: Service) -> None:
    client = service.client()
    started = client.start_memory_profile(max_entries=1000)
    client.train_batch(ragged_batch(seed=4))
    result = client.stop_memory_profile()
    assert result.profile_id == started.profile_id
    assert sorted(f.rank for f in result.files) == [0, 1]
    directory = service.data_dir / "profiles" / result.profile_id
    for f in result.files:
        c = f.coords
        assert f.name == (
            f"snapshot_rank{f.rank:02d}_p{c['pp']}d{c['dp']}c{c['cp']}t{c['tp']}.trace.json"
        )
        path = directory / f.name
        assert path.stat().st_size == f.size_bytes > 0
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("name") == "[memory]" for e in events), "no allocation events recorded"
