"""The sampler side of an asynchronous RL loop: rollouts kept in flight while the trainer trains.

``Rollouts`` keeps ``in_flight`` sample requests working, each of ``per_request`` prompts. A
request samples ``n`` completions of each prompt from the service's newest weights (the
service paces one whose weights would be past its ``--max-staleness``), then runs every
completion through the caller's environment (a coroutine: a tool call, a sandbox, a reward
model), all at once. ``next()`` hands back a finished ``Group`` (the oldest request's first),
and once a request's groups are all handed back another request starts: sampling and the
environment overlap the training step the loop takes on the groups before. A group knows the
steps that sampled it, and ``Group.sequences`` carries them back to training (``token_steps``),
where the service holds its staleness bound::

    async with AsyncTrainctlClient(url) as tc, Rollouts(
        tc, prompts, env, in_flight=1, per_request=8, n=8
    ) as r:
        while True:
            groups = [await r.next() for _ in range(8)]
            batch = [s for g in groups for s in g.sequences(g.advantages())]
            await tc.forward_backward(batch, loss={"kind": "ppo"})
            await tc.optim_step()

``idle_fraction`` says how much of the time no sample request was in flight: the samplers'
idle share as this client sees it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainctl.api import Completion
from trainctl.api.batch import TokenSequence
from trainctl.clients.async_ import AsyncTrainctlClient

Environment = Callable[[list[int], Completion], Awaitable[float]]
"""Scores one completion of a prompt: its reward."""


@dataclass(frozen=True)
class Group:
    """One prompt's completions, their rewards, and the step the samplers started them with."""

    prompt: list[int]
    completions: list[Completion]
    rewards: list[float]
    step: int

    @property
    def oldest_step(self) -> int:
        """The oldest weights step of any of its tokens (with in-flight updates a completion's
        later tokens may be newer)."""
        return min((s for c in self.completions for s in c.token_steps or ()), default=self.step)

    def advantages(self) -> list[float]:
        """Group-relative advantages (GRPO's): each reward minus the group's mean."""
        mean = float(np.mean(self.rewards))
        return [r - mean for r in self.rewards]

    def sequences(self, advantages: list[float]) -> list[TokenSequence]:
        """The training sequences, one per completion, with its steps and log-probs."""
        return [
            c.sequence(self.prompt, a) for c, a in zip(self.completions, advantages, strict=True)
        ]


class Rollouts:
    """Owns the groups in flight, the prompts still to sample, and the timing of the samplers'
    busy spells as this client saw them."""

    def __init__(
        self,
        client: AsyncTrainctlClient,
        prompts: Iterator[list[int]],
        environment: Environment,
        *,
        in_flight: int = 2,
        per_request: int = 1,
        **sample: Any,
    ) -> None:
        """``in_flight`` sample requests at once, each of ``per_request`` prompts (one request
        of a step's prompts costs the service less than one per prompt); ``sample``: the
        keyword arguments of every ``client.sample`` (``n``, ``max_tokens``, ...)."""
        if in_flight < 1 or per_request < 1:
            raise ValueError(f"in_flight and per_request must be at least 1: {in_flight}, "
                             f"{per_request}")  # fmt: skip
        self.client, self.prompts, self.environment = client, prompts, environment
        self.in_flight, self.per_request, self.sample = in_flight, per_request, sample
        self._tasks: list[asyncio.Task[list[Group]]] = []
        """The requests in flight, oldest first."""
        self._ready: list[Group] = []
        """Groups finished and not handed back yet, oldest first."""
        self._sampling = 0
        self._busy_since: float | None = None
        self.busy_s = 0.0
        """Seconds during which at least one sample request was in flight."""
        self.started = time.perf_counter()

    async def __aenter__(self) -> Rollouts:
        self._fill()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the groups in flight (their sample requests are aborted on the service)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    @property
    def idle_fraction(self) -> float:
        """The share of the time since the start when no sample request was in flight."""
        now = time.perf_counter()
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return 1.0 - busy / max(now - self.started, 1e-9)

    async def next(self) -> Group:
        """The next group to finish (a request whose sampling or environment failed raises
        here); once a request's groups are all handed back, another request starts."""
        self._fill()
        while not self._ready:
            if not self._tasks:
                raise StopAsyncIteration("no prompts left")
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            task = next(t for t in self._tasks if t in done)  # the oldest that finished
            self._tasks.remove(task)
            self._ready.extend(task.result())
            self._fill()
        return self._ready.pop(0)

    def _fill(self) -> None:
        while len(self._tasks) < self.in_flight:
            prompts = list(itertools.islice(self.prompts, self.per_request))
            if not prompts:
                return
            self._tasks.append(asyncio.create_task(self._request(prompts)))

    async def _request(self, prompts: list[list[int]]) -> list[Group]:
        self._began()
        try:
            result = await self.client.sample(prompts, **self.sample)
        finally:
            self._ended()
        rollouts = [(p, c) for p, ps in zip(prompts, result.samples, strict=True)
                    for c in ps.completions]  # fmt: skip
        rewards = iter(await asyncio.gather(*(self.environment(p, c) for p, c in rollouts)))
        return [
            Group(p, ps.completions, [float(next(rewards)) for _ in ps.completions], result.step)
            for p, ps in zip(prompts, result.samples, strict=True)
        ]

    def _began(self) -> None:
        if self._sampling == 0:
            self._busy_since = time.perf_counter()
        self._sampling += 1

    def _ended(self) -> None:
        self._sampling -= 1
        if self._sampling == 0 and self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
