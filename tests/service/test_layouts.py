"""The running service at dp2 x cp2 and tp2 x pp2 (4 ranks each), driven over HTTP: one
train step gives the loss and grad norm of the single-rank engine, and the eval loss after the
step - a function of every parameter - matches too (1e-5 relative)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainctl.service.launch import engine_config_dict
from trainctl.service.settings import Settings

from conftest import Service, running_service
from test_service import ragged_batch

REFERENCE = Path(__file__).parents[1] / "reference.py"
LAYOUTS = {"dp2cp2": {"dp": 2, "cp": 2}, "tp2pp2": {"dp": 1, "tp": 2, "pp": 2}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Service]]:
    flags = [f"--{k}={v}" for k, v in LAYOUTS[request.param].items()]
    with running_service(tmp_path_factory.mktemp(request.param), *flags) as svc:
        yield request.param, svc


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b))


def _reference(mode: str, batch: list[dict]) -> Any:
    cfg = engine_config_dict(Settings(dp=1, cp=1, tp=1, pp=1))
    ref = subprocess.run(
        [sys.executable, str(REFERENCE)],
        input=json.dumps({"mode": mode, "sequences": batch, "engine": cfg}),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(ref.stdout.strip().splitlines()[-1])


def test_logprobs_match_a_single_process_computation(layout_service: tuple[str, Service]) -> None:
    """Put back together from CP shards and DP ranks, in the caller's order (run first: the
    reference is the untrained model)."""
    _, svc = layout_service
    client = svc.client()
    assert client.info().step == 0
    batch = ragged_batch(seed=6)
    got = client.logprobs(batch, entropy=True)
    want = _reference("logprobs", batch)
    assert [len(x) for x in got.logprobs] == [len(s["tokens"]) for s in batch]
    for g, w in zip(got.logprobs, want, strict=True):
        assert np.allclose(g, w, rtol=1e-5, atol=1e-5), (g, w)
    assert got.entropy is not None and all(e[0] == 0.0 and min(e[1:]) > 0 for e in got.entropy)


def test_train_step_matches_single_rank(layout_service: tuple[str, Service]) -> None:
    name, svc = layout_service
    client = svc.client()
    info = client.info()
    assert info.world_size == 4 and all(info.layout[k] == v for k, v in LAYOUTS[name].items())
    batch = ragged_batch(seed=5)
    before = client.eval_batch(batch).loss
    step = client.train_batch(batch)
    after = client.eval_batch(batch).loss

    want = _reference("step", batch)
    assert _close(before, want["eval_before"]), (before, want)
    assert _close(step.loss, want["loss"]), (step.loss, want)
    assert _close(step.metrics["grad_norm:value"], want["grad_norm"]), (step.metrics, want)
    assert _close(after, want["eval_after"]), (after, want)
