"""Tinker's ``snapshot`` contract through the real SDK, one check for every sampler set-up
(full fine-tuning on one engine or two, a LoRA adapter): a sampling client made at step k
samples exactly step k's weights while k is in the samplers' window, beside one made two steps
later, and once k leaves the window it is refused with a 410 that says so, never answered
with other weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tinker import types

from trainctl.clients import TrainctlClient

from helpers.parity import PARITY

APART = 1e-3
"""Two steps' log-probs differ by more than this (the check is not vacuous)."""
SCORED = [5, 17, 3, 9, 22, 41, 7, 7]


def datum(tokens: list[int]) -> Any:
    """A cross-entropy datum of Tinker's: each token after the first is a target."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64)},
    )


def _gap(a: list[float | None], b: list[float | None]) -> float:
    return float(np.abs(np.asarray(a[1:], float) - np.asarray(b[1:], float)).max())


def snapshots_hold_through_the_window(
    training: Any, native: TrainctlClient, adapter: str | None, window: int
) -> dict[str, Any]:
    """With the Tinker training client ``training`` (of the base when ``adapter`` is None):
    the trainer's log-probs of ``SCORED`` at the current step k, a snapshot client made then;
    ``window - 1`` steps, each published for sampling, a second client; both sampled in turn
    three times, each equal to its own step's trainer log-probs; one step more and the first
    is a 410 naming step k, while the second still gives its values. Returns the steps and
    what ``info`` listed."""

    def trainer() -> list[float | None]:
        return list(native.logprobs([SCORED], adapter=adapter).logprobs[0])

    def step() -> None:  # published as an RL loop publishes each step (a manual service too)
        training.forward_backward([datum(SCORED)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        training.save_weights_and_get_sampling_client().result()

    def scored(client: Any) -> list[float | None]:
        return list(client.compute_logprobs(types.ModelInput.from_ints(SCORED)).result())

    first_step = _step(native, adapter)
    first, first_want = training.save_weights_and_get_sampling_client().result(), trainer()
    for _ in range(window - 1):
        step()
    last_step = _step(native, adapter)
    last, last_want = training.save_weights_and_get_sampling_client().result(), trainer()
    assert _gap(first_want, last_want) > APART, "the steps did not change the log-probs"
    for _ in range(3):  # in turn: a one-engine sampler swaps each version in when named
        for client, want in ((first, first_want), (last, last_want)):
            assert _gap(scored(client), want) <= PARITY
    served = native.info().samplers
    assert served is not None
    listed = served.versions if adapter is None else served.adapter_versions[adapter]
    assert (served.window, listed) == (window, list(range(first_step, last_step + 1))), served

    step()  # the first client's step leaves the window
    gone = (
        rf"step {first_step}, which have left the samplers' window of {window} versions "
        rf"\(--sampler-versions {window};.*a larger --sampler-versions"
    )
    with pytest.raises(Exception, match=gone):
        first.sample(
            types.ModelInput.from_ints(SCORED[:4]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    assert _gap(scored(last), last_want) <= PARITY
    return {"steps": (first_step, last_step), "listed": listed}


def _step(native: TrainctlClient, adapter: str | None) -> int:
    if adapter is None:
        return native.info().step
    (held,) = [a for a in native.list_adapters().adapters if a.name == adapter]
    return held.step
