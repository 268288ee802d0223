"""The SDK's rollout helper (``clients/rollouts.py``) against a stand-in client: how many
requests it keeps in flight, that every group comes back once with its own rewards and steps,
that a failed request surfaces, and its view of the samplers' idle time."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from trainctl.api import Completion, PromptSamples, SampleResult
from trainctl.clients.rollouts import Group, Rollouts


class _Client:
    """Answers ``sample`` after ``delay_s`` with one completion per ``n`` whose tokens are the
    prompt's first id, sampled at ``step``; records how many requests ran at once."""

    def __init__(self, delay_s: float = 0.05, fail_on: int | None = None) -> None:
        self.delay_s, self.fail_on = delay_s, fail_on
        self.running = self.most = self.calls = 0
        self.step = 0

    async def sample(self, prompts: list[list[int]], n: int = 1, **_: Any) -> SampleResult:
        self.calls += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_on is not None and prompts[0][0] == self.fail_on:
                raise RuntimeError(f"prompt {self.fail_on} failed")
            samples = [
                PromptSamples(completions=[
                    Completion(tokens=[p[0], i], finish_reason="length",
                               token_steps=[self.step, self.step + (i % 2)])
                    for i in range(n)
                ])
                for p in prompts
            ]  # fmt: skip
            return SampleResult(samples=samples, step=self.step, sampler=0, seconds=0.0)
        finally:
            self.running -= 1


async def _reward(prompt: list[int], c: Completion) -> float:
    await asyncio.sleep(0.01)
    return float(c.tokens[1])


def _prompts() -> Any:
    return ([k] for k in itertools.count())


def test_it_keeps_in_flight_requests_of_per_request_prompts_and_hands_back_each_group() -> None:
    async def run() -> tuple[list[Group], _Client]:
        client = _Client()
        async with Rollouts(client, _prompts(), _reward, in_flight=2, per_request=3,  # type: ignore[arg-type]
                            n=4) as r:  # fmt: skip
            groups = [await r.next() for _ in range(9)]
        return groups, client

    groups, client = asyncio.run(run())
    assert [g.prompt for g in groups] == [[k] for k in range(9)]  # each once, in order
    assert client.most == 2 and client.calls >= 3
    g = groups[4]
    assert g.rewards == [0.0, 1.0, 2.0, 3.0] and g.advantages() == [-1.5, -0.5, 0.5, 1.5]
    assert g.step == 0 and g.oldest_step == 0
    seqs = g.sequences(g.advantages())
    assert [s.tokens.tolist() for s in seqs] == [[4, 4, i] for i in range(4)]
    assert [s.token_steps.tolist() for s in seqs] == [[-1, 0, 0 + (i % 2)] for i in range(4)]


def test_a_failed_request_raises_from_next() -> None:
    async def run() -> None:
        client = _Client(fail_on=0)
        async with Rollouts(client, _prompts(), _reward, in_flight=1) as r:  # type: ignore[arg-type]
            await r.next()

    with pytest.raises(RuntimeError, match="prompt 0 failed"):
        asyncio.run(run())


def test_idle_fraction_is_the_time_no_request_was_in_flight() -> None:
    async def run() -> float:
        client = _Client(delay_s=0.2)
        async with Rollouts(client, _prompts(), _reward, in_flight=1) as r:  # type: ignore[arg-type]
            await r.next()  # 0.2 s sampling, then 0.01 s in the environment
            await asyncio.sleep(0.0)
            idle = r.idle_fraction
        return idle

    idle = asyncio.run(run())
    assert 0.0 < idle < 0.3  # sampling all but the environment's 0.01 s (and scheduling)
    with pytest.raises(ValueError, match="at least 1"):
        Rollouts(_Client(), _prompts(), _reward, in_flight=0)  # type: ignore[arg-type]
