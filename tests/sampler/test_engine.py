"""A sampler engine survives what its callers send it: a request that raises inside vLLM fails
alone (the engine was left holding it, and every later call waited on it for good), and a
weight set whose shapes differ from the served one is refused before any tensor is copied."""

from __future__ import annotations

import multiprocessing as mp

import one_engine_cases as cases


def test_a_failing_request_and_a_misshapen_load_leave_the_engine_serving() -> None:
    with mp.get_context("spawn").Pool(1) as pool:
        out = pool.apply_async(cases.jam_then_refused_load).get(timeout=600)
    status, message = out["bad_seed"]
    assert status == 500 and "failed this request" in message, out
    assert out["after_bad_seed"], "the engine answered differently (or not) after the error"
    status, message = out["wrong_shape"]
    assert status == 500 and "down_proj" in message and "refused" in message, out
    assert out["step_after_refusal"] == 1 and out["after_refusal"], out
    assert out["after_a_good_load"], "a later good load must still take effect"
