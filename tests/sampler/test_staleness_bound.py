"""The staleness bound held by a real service (``--max-staleness 1``, one vLLM engine synced on
demand): sampled data carries its steps back through the SDK, training on data too far behind
the trainer is a 409 that changes nothing (or is counted with ``staleness: "report"``), bad
steps are 422s naming the token, sampling for the newest weights waits for a sync (or answers
a retryable 503), and ``/metrics`` counts every sequence's staleness."""

from __future__ import annotations

import re
import threading
import time

import pytest

from trainctl.api import ConflictError, InvalidRequestError, NotReadyError, SampleResult
from trainctl.clients import RetryPolicy

from helpers.parity import PACE_WAIT_S
from helpers.servicekit import Service

PROMPT = [1, 2, 3, 4]
LOSS = {"kind": "importance_sampling"}


def _rollouts(result: SampleResult) -> list:  # type: ignore[type-arg]
    """The SDK's training sequences of a sample result, with advantages of mean zero."""
    completions = result.samples[0].completions
    return [c.sequence(PROMPT, advantage=(-1.0) ** i) for i, c in enumerate(completions)]


def _staleness_count(text: str) -> float:
    m = re.search(r"^trainctl_staleness_steps_count (\S+)$", text, re.M)
    assert m, "no trainctl_staleness_steps histogram in /metrics"
    return float(m.group(1))


def test_data_past_the_bound_is_refused_or_reported_and_nothing_changes(paced: Service) -> None:
    with paced.client() as tc:
        start = tc.info().step
        sampled = tc.sample([PROMPT], n=4, max_tokens=6, temperature=1.0)
        assert sampled.step == start
        seqs = _rollouts(sampled)
        assert all(s.token_steps.tolist() == [-1] * 4 + [start] * 6 for s in seqs)
        before = _staleness_count(tc.metrics())

        r = tc.train_batch(seqs, loss=LOSS)  # as fresh as it gets
        assert r.metrics["staleness:max"] == 0.0 and r.metrics["stale_sequences:count"] == 0.0
        r = tc.train_batch(seqs, loss=LOSS)  # one step behind: the bound
        assert r.metrics["staleness:max"] == 1.0 and r.step == start + 2

        with pytest.raises(ConflictError) as e:  # two steps behind
            tc.train_batch(seqs, loss=LOSS)
        assert e.value.status == 409
        assert e.value.details["stale"] == [[i, start] for i in range(4)]
        assert "--max-staleness 1" in e.value.message and 'staleness: "report"' in e.value.message
        with pytest.raises(ConflictError):
            tc.forward_backward(seqs, loss=LOSS)
        assert tc.info().step == start + 2  # nothing applied, no part waiting
        tc.train_batch(seqs, loss=LOSS, staleness="report")  # would fail with a part waiting

        reported = tc.info().step
        assert reported == start + 3
        fb = tc.forward_backward(seqs, loss=LOSS, staleness="report")
        assert fb.metrics["stale_sequences:count"] == 4.0 and fb.metrics["staleness:max"] == 3.0
        stepped = tc.optim_step()  # reports its parts' staleness (the trackers log it)
        assert stepped.step == start + 4 and stepped.metrics["staleness:max"] == 3.0
        assert stepped.metrics["stale_sequences:count"] == 4.0
        # 2 accepted + 1 reported train_batch + 1 reported forward_backward, 4 sequences each
        assert _staleness_count(tc.metrics()) - before == 16


def test_steps_in_the_future_unknown_or_missing_are_422s_naming_the_token(paced: Service) -> None:
    with paced.client() as tc:
        step = tc.info().step
        served = tc.info().samplers.versions  # type: ignore[union-attr]
        unknown = next(k for k in range(step) if k not in served) if step else None
        cases = [
            ({"tokens": [1, 2, 3], "policy_step": step + 1}, "sequences[0].token_steps[0]",
             f"step {step + 1} is in the future"),
            ({"tokens": [1, 2, 3], "token_steps": [-1, served[-1], -1]},
             "sequences[0].token_steps[2]", "a loss token with no step"),
        ]  # fmt: skip
        if unknown is not None:
            cases.append(
                ({"tokens": [1, 2, 3], "policy_step": unknown}, "sequences[0].token_steps[0]",
                 "was never served by the samplers")
            )  # fmt: skip
        for seq, field, problem in cases:
            with pytest.raises(InvalidRequestError) as e:
                tc.train_batch([seq])
            assert e.value.status == 422
            assert e.value.details["field"] == field and problem in e.value.message, e.value
        assert tc.info().step == step


def test_sampling_waits_for_weights_within_the_bound(paced: Service) -> None:
    no_retry = RetryPolicy(max_retries=0)
    with paced.client() as tc, paced.client(retry=no_retry) as raw:
        tc.sync_weights()
        fresh = tc.sample([PROMPT], n=2, max_tokens=4)
        seqs = _rollouts(fresh)
        for _ in range(2):  # the trainer moves two steps ahead of the samplers
            tc.train_batch(seqs, loss=LOSS, staleness="report")
        trainer = tc.info().step
        assert trainer - tc.info().samplers.step == 2  # type: ignore[union-attr]

        # no sync comes: a retryable 503 after the wait, nothing sampled
        t0 = time.monotonic()
        with pytest.raises(NotReadyError) as e:
            raw.sample([PROMPT], max_tokens=4)
        waited = time.monotonic() - t0
        assert e.value.status == 503 and PACE_WAIT_S - 0.5 < waited < PACE_WAIT_S + 10
        assert "2 steps behind the trainer, more than --max-staleness 1" in e.value.message

        # a pinned step is never paced: it asked for those weights
        assert raw.sample([PROMPT], max_tokens=4, step=fresh.step).step == fresh.step

        # a sync while it waits releases it, with the new weights
        got: list[SampleResult] = []
        waiting = threading.Thread(target=lambda: got.append(raw.sample([PROMPT], max_tokens=4)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive()
        tc.sync_weights()
        waiting.join(30)
        assert got and got[0].step == trainer


def test_a_prompt_sampled_again_after_a_sync_sees_only_the_new_weights(paced: Service) -> None:
    """vLLM keeps a prompt's attention keys and values in its prefix cache; after a weight load
    the cached blocks were computed with the old weights, and a request that shares them must
    not read them (an RL loop samples the same prompts at every step)."""
    vocab = 512
    prompt = [(7 * i + 3) % vocab for i in range(300)]  # two full 128-token cache blocks
    with paced.client() as tc:
        tc.sync_weights()
        tc.sample([prompt], max_tokens=8, temperature=0.0)  # the prompt's blocks, cached
        tc.forward_backward([{"tokens": prompt[:200]}])
        tc.optim_step(lr=1e-2)  # weights that differ clearly
        tc.sync_weights()
        again = tc.sample([prompt], max_tokens=8, temperature=0.0)
        c = again.samples[0].completions[0]
        assert again.step == tc.info().step and c.logprobs is not None
        trainer = tc.logprobs([prompt + c.tokens]).logprobs[0][len(prompt) :]
        gap = max(abs(a - b) for a, b in zip(c.logprobs, trainer, strict=True))
        assert gap < 1e-4, f"sampler log-probs {gap:.3g} from the trainer's after the sync"
