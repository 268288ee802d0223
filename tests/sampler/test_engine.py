"""A sampler engine survives what its callers send it, and keeps the protocol's order.

A request that raises inside vLLM fails alone (the engine was left holding it, and every
later call waited on it for good), and a weight set whose shapes differ from the served one is
refused before any tensor is copied. A request aborted while it waits is dropped, one aborted
while it runs stops within a second; a paused engine holds samples but loads weights. Requests
of one version run at once, and each gets what it gets alone. A request gets the version it
names: an engine that holds another loads it in the request's turn, and labels each token
with it."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import one_engine_cases as cases


def _in_own_process(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    with mp.get_context("spawn").Pool(1) as pool:
        out: dict[str, Any] = pool.apply_async(case).get(timeout=600)
    return out


def test_a_failing_request_and_a_misshapen_load_leave_the_engine_serving() -> None:
    out = _in_own_process(cases.jam_then_refused_load)
    status, message = out["bad_seed"]
    assert status == 500 and "failed this request" in message, out
    assert out["after_bad_seed"], "the engine answered differently (or not) after the error"
    status, message = out["wrong_shape"]
    assert status == 500 and "down_proj" in message and "refused" in message, out
    assert out["step_after_refusal"] == 1 and out["after_refusal"], out
    assert out["after_a_good_load"], "a later good load must still take effect"
    assert out["swapped_back"] == (1, True, 1), out


def test_abort_drops_a_waiting_request_and_stops_a_running_one() -> None:
    out = _in_own_process(cases.aborts)
    assert (out["abort_queued"], out["abort_running"], out["abort_unknown"]) == (True, True, False)
    status, message = out["queued"]
    assert status == 409 and "aborted before it ran" in message, out
    status, message = out["running"]
    assert status == 409 and "aborted while it ran" in message, out
    assert out["running_gone_after_s"] < 1.0, out
    assert out["after_abort"] == 1, out


def test_sixteen_requests_at_once_equal_each_alone() -> None:
    out = _in_own_process(cases.concurrent_equals_alone)
    assert out["peak"] >= 4 and out["steps"] == [1, 2], out  # they did run together
    assert out["token_steps"] == [(1, 1), (2, 2)], out  # every token labelled with its step
    assert out["same_tokens"] and out["logprob_values"] > 200, out
    assert out["max_diff"] <= 1e-4, out
