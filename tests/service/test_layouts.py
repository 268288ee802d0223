"""The running service at dp2 x cp2 (prefix tries, the default) and tp2 x pp2 (flat), 4 ranks
each, driven over HTTP against the single-rank engine (``helpers/layout_checks.py``); dp2 is
the shared service's (``test_service.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers import layout_checks
from helpers.servicekit import Service, running_service

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2cp2-tree": {"dp": 2, "cp": 2, "packing": "tree"},
    "tp2pp2-flat": {"dp": 1, "tp": 2, "pp": 2, "packing": "flat"},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Service]]:
    flags = [f"--{k}={v}" for k, v in LAYOUTS[request.param].items()]
    with running_service(tmp_path_factory.mktemp(request.param), *flags) as svc:
        yield request.param, svc


def test_logprobs_match_a_single_process_computation(layout_service: tuple[str, Service]) -> None:
    """Run first: the reference is the untrained model."""
    name, svc = layout_service
    layout_checks.logprobs_match_a_single_process_computation(svc, LAYOUTS[name]["packing"])


def test_train_step_matches_single_rank(layout_service: tuple[str, Service]) -> None:
    name, svc = layout_service
    layout = {k: v for k, v in LAYOUTS[name].items() if k != "packing"}
    layout_checks.train_step_matches_single_rank(svc, layout, LAYOUTS[name]["packing"])


def test_a_request_chooses_its_packing(layout_service: tuple[str, Service]) -> None:
    layout_checks.a_request_chooses_its_packing(layout_service[1])
