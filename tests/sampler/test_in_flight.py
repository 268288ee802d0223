"""In-flight weight updates (``--sampler-sync in_flight``) on a real service: a generation that
spans a training step's sync is not thrown away or held back; it goes on with the new weights,
each token says which step sampled it, and each token's log-prob is the trainer's at that step
given the same prefix, which needs vLLM to recompute the running sequences' keys and values."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainctl.api import SampleResult

from helpers.servicekit import Service, running_service

PROMPTS = [[1 + i, 2, 3, 4] for i in range(16)]
MAX_TOKENS = 64


def _sample_across_a_step(tc, step: int) -> SampleResult:  # type: ignore[no-untyped-def]
    """A long sample, and a training step (synced in flight) while it runs; retried until one
    completion spans both steps (a step that lands after the generation proves nothing)."""
    for _ in range(4):
        got: list[SampleResult] = []

        def sample(into: list[SampleResult] = got) -> None:
            into.append(tc.sample(PROMPTS, n=16, max_tokens=MAX_TOKENS, temperature=1.0, seed=7))

        long = threading.Thread(target=sample)
        long.start()
        tc.train_batch([{"tokens": p * 8} for p in PROMPTS[:4]])
        long.join(300)
        assert got, "the sample did not answer"
        steps = {s for ps in got[0].samples for c in ps.completions for s in c.token_steps or []}
        if len(steps) == 2:
            return got[0]
        tc.save_checkpoint(f"at-{tc.info().step}", overwrite=True)
    raise AssertionError("no completion spanned the sync in four tries")


def test_a_generation_spanning_a_sync_goes_on_with_the_new_weights(in_flight: Service) -> None:
    with in_flight.client() as tc:
        tc.save_checkpoint(f"at-{tc.info().step}", overwrite=True)
        result = _sample_across_a_step(tc, tc.info().step)
        after = tc.info().step
        before = after - 1
        tc.save_checkpoint(f"at-{after}", overwrite=True)
        spans = [c for ps in result.samples for c in ps.completions
                 if len(set(c.token_steps or [])) == 2]  # fmt: skip
        assert spans and all(c.token_steps == sorted(c.token_steps or []) for c in spans)
        assert any(len(c.tokens) == MAX_TOKENS for c in spans)  # a whole 64-token generation
        assert {s for c in spans for s in c.token_steps or []} == {before, after}

        # the trainer's log-probs of every sequence at both steps
        seqs, owners = [], []
        for prompt, ps in zip(PROMPTS, result.samples, strict=True):
            for c in ps.completions:
                seqs.append(prompt + c.tokens)
                owners.append((len(prompt), c))
        scored = {after: tc.logprobs(seqs).logprobs}
        tc.load_checkpoint(f"at-{before}")
        scored[before] = tc.logprobs(seqs).logprobs
        tc.load_checkpoint(f"at-{after}")

        gap, gap_spanning = 0.0, 0.0
        for i, (n, c) in enumerate(owners):
            assert c.logprobs is not None and c.token_steps is not None
            for t, (lp, s) in enumerate(zip(c.logprobs, c.token_steps, strict=True)):
                d = abs(lp - scored[s][i][n + t])
                gap = max(gap, d)
                if len(set(c.token_steps)) == 2:
                    gap_spanning = max(gap_spanning, d)
        print(f"{len(spans)} of {len(owners)} completions span steps {before} and {after}; "
              f"largest gap {gap:.2e} (spanning: {gap_spanning:.2e})")  # fmt: skip
        assert gap_spanning < 1e-4 and gap < 1e-4


def test_the_async_example_learns_one_step_off_policy(in_flight: Service) -> None:
    """``examples/async_rl.py``'s loop through the SDK's ``Rollouts``: trains on groups sampled
    while it trained, within one step of the trainer, to the synchronous loop's reward."""
    import argparse
    import asyncio
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from examples import async_rl

    args = argparse.Namespace(delay=0.05, prompts=8, until=0.8, max_iterations=60, lr=2e-3,
                              seed=0, in_flight=1)  # fmt: skip
    run = asyncio.run(async_rl.one(in_flight.url, "async", args, quiet=True))
    print(f"{run.iterations} iterations, rewards {run.rewards[0]:.2f} -> {run.rewards[-1]:.2f}, "
          f"staleness max {run.stale_max:.0f}, samplers idle {run.idle:.0%}")  # fmt: skip
    assert run.rewards[0] < 0.3 and run.reached(0.8)
    assert run.stale_max == 1.0  # off-policy by one step: never on-policy, never two behind


def test_the_async_examples_timeline_draws_both_loops(in_flight: Service, tmp_path: Path) -> None:
    """``examples/async_rl.py --timeline``: two iterations of each loop, each one's timeline
    (the controller's operations, the rank's work, the engine's samples and loads) and a PNG
    of both."""
    import argparse
    import json
    import sys

    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from examples import async_rl

    args = argparse.Namespace(delay=0.05, prompts=4, until=0.8, max_iterations=60, lr=2e-3,
                              seed=0, in_flight=1)  # fmt: skip
    async_rl.timelines(in_flight.url, args, str(tmp_path / "t"))
    for mode in ("sync", "async"):
        trace = json.loads((tmp_path / f"t-{mode}.json").read_text())
        meta = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
        rows = {e["pid"]: e["args"]["name"] for e in meta}
        seen = {(rows[e["pid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
        for row, name in [("controller", "forward_backward"), ("controller", "optim_step"),
                          ("rank 0", "optimizer"), ("engine 0", "sample"),
                          ("engine 0", "sync")]:  # fmt: skip
            assert (row, name) in seen, (mode, row, name)
    png = (tmp_path / "t.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


@pytest.fixture(scope="module")
def lora_in_flight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default (a frozen base) with room for two adapters and one sampler
    engine updated in flight after every step."""
    data = tmp_path_factory.mktemp("lora-in-flight")
    flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "in_flight",
             "--max-adapters", "2", "--lora-max-rank", "8")  # fmt: skip
    with running_service(data, *flags) as svc:
        yield svc


def test_an_adapter_syncs_beside_its_long_sample_and_the_sample_goes_on_with_it(
    lora_in_flight: Service,
) -> None:
    """An adapter's sync with a long sample running in its lane: it does not wait for the
    sample (under 1 s, the sample still running), and the sample's tokens after it are the
    new version's: ``token_steps`` shows both, in order, and each token's log-prob is the
    trainer's adapter at that token's step."""
    rows = [{"tokens": p * 4, "loss_mask": [1] * len(p) * 4} for p in PROMPTS[:4]]
    with lora_in_flight.client() as tc:
        tc.create_adapter("fly", rank=8, alpha=16.0)
        tc.forward_backward(rows, adapter="fly")
        before = tc.optim_step(lr=5e-2, adapter="fly").step
        for _ in range(4):
            tc.save_checkpoint("fly-before", overwrite=True)
            got: list[SampleResult] = []

            def sample(into: list[SampleResult] = got) -> None:
                into.append(tc.sample(PROMPTS, n=16, max_tokens=MAX_TOKENS, temperature=1.0,
                                      seed=7, adapter="fly", logprobs=True))  # fmt: skip

            long = threading.Thread(target=sample)
            long.start()
            time.sleep(0.5)  # the sample is in the engine
            tc.forward_backward(rows, adapter="fly")
            after = tc.optim_step(lr=5e-2, adapter="fly")
            still_running = long.is_alive()
            sync = tc.info().samplers.last_sync  # type: ignore[union-attr]
            long.join(300)
            assert got, "the sample did not answer"
            assert after.warnings == [] and sync is not None and sync.adapter == "fly", sync
            assert sync.step == after.step == before + 1, sync
            steps = [c.token_steps for ps in got[0].samples for c in ps.completions]
            spanning = [s for s in steps if s is not None and len(set(s)) == 2]
            if still_running and spanning:
                break
            before = after.step  # the sample ended before the sync: again
        else:
            raise AssertionError("no completion spanned the adapter's sync in four tries")
        print(
            f"the adapter's sync took {sync.load_s * 1e3:.0f} ms beside the sample; "
            f"{len(spanning)} of {len(steps)} completions span steps {before} and {after.step}"
        )
        assert sync.load_s < 1.0
        assert all(s == sorted(s) and set(s) == {before, after.step} for s in spanning)
        assert got[0].step == before  # the step it was admitted with

        seqs, owners = [], []
        for prompt, ps in zip(PROMPTS, got[0].samples, strict=True):
            for c in ps.completions:
                seqs.append(prompt + c.tokens)
                owners.append((len(prompt), c))
        scored = {after.step: tc.logprobs(seqs, adapter="fly").logprobs}
        tc.load_checkpoint("fly-before")
        scored[before] = tc.logprobs(seqs, adapter="fly").logprobs
        assert abs(scored[before][0][5] - scored[after.step][0][5]) > 1e-3  # the steps differ
        gap = max(
            abs(lp - scored[step][i][n + t])
            for i, (n, c) in enumerate(owners)
            for t, (lp, step) in enumerate(zip(c.logprobs or [], c.token_steps or [], strict=True))
        )
        print(f"largest gap to the trainer's adapter at each token's step: {gap:.2e}")
        assert gap < 1e-4
        tc.delete_adapter("fly")
