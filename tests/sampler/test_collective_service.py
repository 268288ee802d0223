"""The service with ``--sampler-transport collective``: rank 0 broadcasts the merged weights
over a gloo group while both engines receive them through vLLM's weight-sync API. Every step
reaches both engines, their log-probs equal the trainer's as the object store's do, and a
client pinned to a replaced step gets it from the copy each engine kept. A killed engine comes
back without weights (a broadcast cannot be replayed) and the next sync, over a group formed
anew, reaches it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.parity import PARITY, PROMPTS, WINDOW, gap
from helpers.servicekit import Service, running_service


@pytest.fixture(scope="module")
def collective(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("collective")
    flags = ("--dp", "2", "--samplers", "2", "--sampler-transport", "collective",
             "--sampler-versions", str(WINDOW))  # fmt: skip
    with running_service(Path(data), *flags) as svc:
        yield svc


def _flat(r: object) -> tuple[list[list[int]], list[float]]:
    samples = r.samples  # type: ignore[attr-defined]
    tokens = [c.tokens for s in samples for c in s.completions]
    lps = [x for s in samples for c in s.completions for x in c.logprobs or []]
    return tokens, lps


def test_three_steps_reach_both_engines_exactly(collective: Service) -> None:
    with collective.client() as tc:
        info = tc.info()
        assert info.samplers is not None and info.samplers.step == info.step == 0
        probe = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
        batch = [{"tokens": p, "loss_mask": [1] * len(p)} for p in probe]
        seen: dict[int, tuple[list[list[int]], list[float]]] = {}
        for expected in (1, 2, 3):
            step = tc.train_batch(batch)
            assert step.step == expected and step.warnings == [], step
            info = tc.info()
            assert info.samplers is not None and info.samplers.last_sync is not None
            assert info.samplers.last_sync.samplers == 2, info.samplers.last_sync
            assert [e.step for e in info.samplers.engines] == [expected, expected]
            # Several requests at once: both engines answer, each as the trainer scores it.
            for seed in range(4):
                r = tc.sample(PROMPTS, n=2, max_tokens=8, seed=seed, logprobs=True,
                              prompt_logprobs=True)  # fmt: skip
                assert r.step == expected and gap(tc, r, PROMPTS) <= PARITY / 10  # measured < 1e-6
            pinned = tc.sample(PROMPTS, n=2, max_tokens=8, seed=11, logprobs=True)
            seen[expected] = _flat(pinned)
        # A client pinned to step 2 after step 3: the engine swaps back to its kept copy.
        again = tc.sample(PROMPTS, n=2, max_tokens=8, seed=11, logprobs=True, step=2)
        assert again.step == 2 and _flat(again) == seen[2]
        newest = tc.sample(PROMPTS, n=2, max_tokens=8, seed=11, logprobs=True)
        assert newest.step == 3 and _flat(newest) == seen[3]


def test_a_killed_engine_gets_the_next_sync_over_a_new_group(collective: Service) -> None:
    probe = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    batch = [{"tokens": p, "loss_mask": [1] * len(p)} for p in probe]
    with collective.client() as tc:
        victim = tc.info().samplers.engines[1]  # type: ignore[union-attr]
        assert victim.pid is not None and victim.status == "ready"
        os.kill(victim.pid, signal.SIGKILL)
        # The sync of this step finds it dead (a ping) and reaches the other engine alone.
        step = tc.train_batch(batch)
        assert "loaded by 1 of 2 samplers" in " ".join(step.warnings), step
        r = tc.sample(PROMPTS, n=2, max_tokens=8, seed=1, prompt_logprobs=True)
        assert r.step == step.step and gap(tc, r, PROMPTS) <= PARITY / 10
        deadline = time.monotonic() + 300
        engine = tc.info().samplers.engines[1]  # type: ignore[union-attr]
        while engine.status != "ready" and time.monotonic() < deadline:
            time.sleep(1)
            engine = tc.info().samplers.engines[1]  # type: ignore[union-attr]
        assert engine.status == "ready" and engine.pid != victim.pid, engine
        assert engine.step is None, engine  # a broadcast is not replayed: the next sync
        step = tc.train_batch(batch)
        assert step.warnings == [], step
        info = tc.info()
        assert [e.step for e in info.samplers.engines] == [step.step, step.step]  # type: ignore[union-attr]
        for seed in range(4):  # both engines, as the trainer scores it
            r = tc.sample(PROMPTS, n=2, max_tokens=8, seed=seed, prompt_logprobs=True)
            assert r.step == step.step and gap(tc, r, PROMPTS) <= PARITY / 10
