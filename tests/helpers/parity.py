"""Sampler against trainer: the log-prob vLLM reports for each token it sampled (and for each
prompt token) equals the trainer's ``/v1/logprobs`` of the same sequence."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainctl.api import SampleResult
from trainctl.clients import TrainctlClient

PARITY = 1e-4
"""Sampler vs trainer log-probs in fp32 (measured: below 1e-6)."""
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [40, 41, 42, 43, 44, 45], [5]]
SAMPLER_TIMEOUT_S = 20.0
"""``lora_sampled``'s --sampler-timeout-s (conftest.py): a call not answered by then marks the
engine stopped (``tests/sampler/test_sampler_robustness.py`` stops one)."""
MAX_QUEUED = 12
"""``lora_sampled``'s --sampler-max-queued: more samples at once answer 429."""
MAX_QUEUED_TOKENS = 50_000
"""``lora_sampled``'s --sampler-max-queued-tokens."""
WINDOW = 3
"""``sampled``'s and ``lora_sampled``'s --sampler-versions: a snapshot client made at step k
samples step k until step k + 3."""


def scored(result: SampleResult, prompts: list[list[int]]) -> tuple[list[Any], list[float]]:
    """The sampled sequences as a logprobs batch, and the sampler's log-probs of what it
    generated, in the same order (flattened)."""
    seqs, lps = [], []
    for prompt, s in zip(prompts, result.samples, strict=True):
        for c in s.completions:
            assert c.logprobs is not None and len(c.logprobs) == len(c.tokens) > 0
            seqs.append(prompt + c.tokens)
            lps.append(c.logprobs)
    return seqs, lps


def gap(
    tc: TrainctlClient, result: SampleResult, prompts: list[list[int]], adapter: str | None = None
) -> float:
    """Largest |sampler - trainer| over every sampled token and every scored prompt token
    (the trainer's log-probs with ``adapter``, the one the sampler used)."""
    assert result.adapter == adapter
    seqs, lps = scored(result, prompts)
    trainer = tc.logprobs(seqs, adapter=adapter).logprobs
    diffs = [
        np.abs(np.asarray(t[len(t) - len(s) :]) - np.asarray(s)).max()
        for t, s in zip(trainer, lps, strict=True)
    ]
    by_prompt = tc.logprobs(prompts, adapter=adapter).logprobs
    for t, s in zip(by_prompt, result.samples, strict=True):
        if s.prompt_logprobs is not None:
            assert s.prompt_logprobs[0] is None and len(s.prompt_logprobs) == len(t)
        if s.prompt_logprobs is not None and len(t) > 1:
            diffs.append(np.abs(np.asarray(t[1:]) - np.asarray(s.prompt_logprobs[1:])).max())
    return float(max(diffs))


def prompt_scores(
    tc: TrainctlClient, seqs: list[list[int]], adapter: str | None = None, step: int | None = None
) -> np.ndarray:
    """The sampler's log-probs of given sequences (prompt_logprobs: scoring, no sampling),
    with the weights of ``step`` (None: the newest synced)."""
    r = tc.sample(seqs, max_tokens=1, prompt_logprobs=True, adapter=adapter, step=step)
    assert step is None or r.step == step
    return np.concatenate([np.asarray(s.prompt_logprobs[1:], float) for s in r.samples])


PACE_WAIT_S = 4.0
"""How long a paced sample waits for a sync on the ``paced`` service before its 503."""
