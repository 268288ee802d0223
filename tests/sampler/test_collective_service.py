"""The service with ``--sampler-transport collective``: a mixture-of-experts model (Qwen3-MoE,
transformers' own) trained at dp=2 x ep=2, whose two ranks each send the weights they own
(rank 0 the dense ones and half the experts, rank 1 the other half) over a gloo group while
both engines receive and assemble them through vLLM's weight-sync API.

Every step reaches both engines, which answer alike; what they answer equals, exactly, a
fresh engine loaded with the exported weights of that step; a client pinned to a replaced
step gets it from the copy each engine kept. A killed engine comes back without weights (a
broadcast cannot be replayed) and the next sync, over a group formed anew, reaches it, while a
client pinned to the step before is served by the engine that kept it. An engine killed
mid-send (rank 0 told to stall after its first bucket) costs the others nothing: the owners
go on without it, the other engine loads that step, and the next sync reaches both.

(vLLM's CPU build computes this MoE model's log-probs up to 0.1 from transformers' own, for
any weights, through either transport: so the checks here compare engines with engines. The
trainer parity of the collective path is checked on a dense model: ``test_sampler.py``'s
``qwen3_manual``.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import one_engine_cases as cases
from helpers.hf_models import tiny_model
from helpers.parity import PROMPTS, SAMPLER_TIMEOUT_S, WINDOW
from helpers.servicekit import Service, running_service


@pytest.fixture(scope="module")
def collective(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("collective")
    # Larger than the tiny default, so that buckets of 1 MiB are three (two of rank 0); heads
    # of 32, the narrowest vLLM's CPU attention takes.
    shape = dict(vocab_size=512, hidden_size=128, head_dim=32, moe_intermediate_size=128)
    tiny_model("qwen3_moe", data / "hf", **shape)
    flags = ("--init-hf", str(data / "hf"), "--dp", "2", "--ep", "2",
             "--samplers", "2", "--sampler-transport", "collective",
             "--sampler-versions", str(WINDOW), "--sampler-bucket-mb", "1",
             "--sampler-timeout-s", str(SAMPLER_TIMEOUT_S),
             "--enable-fault-injection=true")  # fmt: skip
    with running_service(Path(data), *flags) as svc:
        yield svc


_flat = cases.flat_result
"""Every completion's tokens, and every prompt and completion log-prob, in order."""

PROBE = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
BATCH = [{"tokens": p, "loss_mask": [1] * len(p)} for p in PROBE]
REQUEST = {"prompts": PROMPTS, "n": 2, "max_tokens": 8, "seed": 11, "logprobs": True,
           "prompt_logprobs": True}  # fmt: skip


def _both_engines(tc: Any, **request: Any) -> tuple[int, tuple[list[list[int]], list[float]]]:
    """The same request from both engines (three at once: the pool sends one to the idler
    engine even if that must swap versions in; again until each has answered): the step they
    answered with, and their one answer (they must agree, to the bit)."""
    by_engine: dict[int, Any] = {}
    for _ in range(10):
        with ThreadPoolExecutor(3) as pool:
            by_engine |= {
                r.sampler: r for r in pool.map(lambda _: tc.sample(**(REQUEST | request)), range(3))
            }
        if len(by_engine) == 2:
            break
    assert sorted(by_engine) == [0, 1], by_engine.keys()
    a, b = by_engine[0], by_engine[1]
    assert a.step == b.step and _flat(a) == _flat(b), "the engines hold other weights"
    assert len(_flat(a)[1]) > 30
    return a.step, _flat(a)


def _wait_ready(tc: Any, index: int, old_pid: int) -> Any:
    deadline = time.monotonic() + 300
    engine = tc.info().samplers.engines[index]
    while (engine.status != "ready" or engine.pid == old_pid) and time.monotonic() < deadline:
        time.sleep(1)
        engine = tc.info().samplers.engines[index]
    assert engine.status == "ready" and engine.pid != old_pid, engine
    return engine


def test_three_steps_reach_both_engines(collective: Service) -> None:
    with collective.client() as tc:
        info = tc.info()
        assert info.samplers is not None and info.samplers.step == info.step == 0
        seen = {0: _both_engines(tc)[1]}
        for expected in (1, 2, 3):
            step = tc.train_batch(BATCH)
            assert step.step == expected and step.warnings == [], step
            info = tc.info()
            assert info.samplers is not None and info.samplers.last_sync is not None
            assert info.samplers.last_sync.samplers == 2, info.samplers.last_sync
            assert [e.step for e in info.samplers.engines] == [expected, expected]
            served, seen[expected] = _both_engines(tc)
            assert served == expected and seen[expected] != seen[expected - 1]
        # A client pinned to step 2 after step 3: an engine swaps back to its kept copy.
        again = tc.sample(**REQUEST, step=2)
        assert again.step == 2 and _flat(again) == seen[2]
        assert _both_engines(tc) == (3, seen[3])


def test_an_engine_fed_by_broadcast_equals_a_fresh_engine_exactly(collective: Service) -> None:
    """Greedy samples and prompt and sample log-probs after collective syncs: the same as a
    fresh engine's, loaded with the exported weights of that step (fp32 on a CPU: 0.0)."""
    request = REQUEST | {"n": 1, "temperature": 0.0}
    with collective.client() as tc:
        got = tc.sample(**request)
        exported = tc.export_hf("collective-exact")
    assert exported.step == got.step > 0
    with mp.get_context("spawn").Pool(1) as pool:
        fresh = pool.apply_async(
            cases.fresh_engine_sample, (str(collective.data_dir / exported.path), got.step, request)
        ).get(timeout=600)
    tokens, lps = _flat(got)
    assert len(lps) > 30 and tokens == fresh[0], (tokens, fresh[0])
    assert max(abs(a - b) for a, b in zip(lps, fresh[1], strict=True)) == 0.0


def test_a_killed_engine_gets_the_next_sync_over_a_new_group(collective: Service) -> None:
    with collective.client() as tc:
        before, kept = _both_engines(tc)
        # Engine 0 is the one a tie picks: once recreated it keeps no older version, so a
        # pinned client must be sent to engine 1.
        victim = tc.info().samplers.engines[0]  # type: ignore[union-attr]
        assert victim.pid is not None and victim.status == "ready"
        os.kill(victim.pid, signal.SIGKILL)
        # The sync of this step finds it dead (a ping) and reaches the other engine alone.
        step = tc.train_batch(BATCH)
        assert "loaded by 1 of 2 samplers" in " ".join(step.warnings), step
        r = tc.sample(**REQUEST)
        assert r.step == step.step and r.sampler == 1
        alone = _flat(r)
        engine = _wait_ready(tc, 0, victim.pid)
        assert engine.step is None, engine  # a broadcast is not replayed: the next sync
        previous = step.step
        step = tc.train_batch(BATCH)
        assert step.warnings == [], step
        info = tc.info()
        assert [e.step for e in info.samplers.engines] == [step.step, step.step]  # type: ignore[union-attr]
        assert _both_engines(tc)[0] == step.step
        # Pinned to the step before: only engine 1 kept it (engine 0 came back after it).
        for _ in range(3):
            r = tc.sample(**REQUEST, step=previous)
            assert (r.step, r.sampler, _flat(r)) == (previous, 1, alone)
        # Pinned to the step before the kill: engine 1 kept that too (a window of three).
        r = tc.sample(**REQUEST, step=before)
        assert WINDOW >= 3 and (r.step, r.sampler, _flat(r)) == (before, 1, kept)


def test_an_engine_killed_mid_broadcast_costs_the_others_nothing(collective: Service) -> None:
    with collective.client() as tc:
        served, answer = _both_engines(tc)
        victim = tc.info().samplers.engines[1]  # type: ignore[union-attr]
        assert victim.pid is not None
        r = httpx.post(f"{collective.url}/v1/debug/faults",
                       json={"rank": 0, "phase": "broadcast_stall"})  # fmt: skip
        assert r.status_code == 200, r.text
        result: dict[str, Any] = {}
        training = threading.Thread(target=lambda: result.update(step=tc.train_batch(BATCH)))
        training.start()
        # The step takes under a second here; rank 0 then stalls 10 s after the first of its
        # two buckets (rank 1 sends the third, its experts): kill one engine mid-send.
        time.sleep(5)
        os.kill(victim.pid, signal.SIGKILL)
        # A sample meanwhile waits for the send to end, then gets the new step from the
        # engine that stayed: each owner sends to each engine, and goes on without one that
        # left.
        again = tc.sample(**REQUEST)
        assert again.step == served + 1 and _flat(again) != answer
        training.join(120)
        step = result["step"]
        assert step.step == served + 1 and "loaded by 1 of 2" in " ".join(step.warnings), step
        info = tc.info()
        assert info.samplers is not None and info.samplers.step == served + 1, info.samplers
        assert info.samplers.engines[0].step == served + 1
        assert info.samplers.versions[-1] == served + 1
        _wait_ready(tc, 1, victim.pid)
        step = tc.train_batch(BATCH)  # a new group, with the recreated engine
        assert step.warnings == [], step
        info = tc.info()
        assert [e.step for e in info.samplers.engines] == [step.step, step.step]  # type: ignore[union-attr]
        assert _both_engines(tc)[0] == step.step
