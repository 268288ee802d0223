"""No request can jam a sampler engine, a stopped engine is replaced, and base requests on an
adapter service get no adapter's weights: the live service (``lora_sampled``: one vLLM engine,
LoRA enabled, a short call deadline)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import numpy as np

from helpers.parity import PARITY, PROMPTS, SAMPLER_TIMEOUT_S, gap, prompt_scores
from helpers.servicekit import Service


def test_an_unsigned_64_bit_overflow_seed_is_a_422_and_the_engine_keeps_serving(
    lora_sampled: Service,
) -> None:
    """The seed that jammed an engine for good (2^64: torch's generator refuses it inside
    vLLM's step) is refused at the gateway; the next sample answers, and a weight sync after
    it completes."""
    with lora_sampled.client() as tc:
        ref = tc.sample([[1, 2, 3]], max_tokens=4, seed=11)
        for body in (
            {"prompts": [[1, 2, 3]], "max_tokens": 4, "seed": 2**64},
            {"prompts": [[1, 2, 3]], "max_tokens": 4, "seed": 2**70},
        ):
            r = httpx.post(f"{lora_sampled.url}/v1/sample", json=body, timeout=30)
            assert r.status_code == 422 and r.json()["message"].startswith("seed"), r.text
        tinker = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4, "seed": 2**64}, "base_model": "x",
        }  # fmt: skip
        r = httpx.post(f"{lora_sampled.url}/api/v1/asample", json=tinker, timeout=30,
                       headers={"x-api-key": "tml-x"})  # fmt: skip
        assert r.status_code in (400, 422) and "sampling_params.seed" in r.text, r.text
        after = tc.sample([[1, 2, 3]], max_tokens=4, seed=11)
        assert after.samples == ref.samples
        synced = tc.sync_weights()
        assert synced.samplers == 1 and synced.failures == []


def test_base_requests_get_no_adapters_weights(lora_sampled: Service) -> None:
    """An adapter with a large alpha on attention, the MLP and the unembedding, trained once,
    is in the engine's LoRA slot; base prompt and generated log-probs still equal the trainer's
    base, and the adapter's equal the trainer's with the adapter."""
    with lora_sampled.client() as tc:
        base_before = prompt_scores(tc, PROMPTS)
        tc.create_adapter("loud", rank=8, alpha=2048.0, targets=["attn", "mlp", "unembed"])
        rows = [{"tokens": p, "loss_mask": [1] * len(p)} for p in PROMPTS if len(p) > 1]
        tc.forward_backward(rows, adapter="loud")
        step = tc.optim_step(lr=1e-2, adapter="loud")
        assert step.warnings == [], step.warnings
        loud = tc.sample(PROMPTS, n=2, max_tokens=6, seed=3, prompt_logprobs=True, adapter="loud")
        assert gap(tc, loud, PROMPTS, "loud") <= PARITY  # the adapter is served as trained
        trainer_loud = tc.logprobs(PROMPTS, adapter="loud").logprobs
        trainer_base = tc.logprobs(PROMPTS).logprobs
        apart = max(
            np.abs(np.asarray(a) - b).max() for a, b in zip(trainer_loud, trainer_base, strict=True)
        )
        assert apart > 1.0, apart  # it moved far from the base: serving it for the base shows
        base = tc.sample(PROMPTS, n=2, max_tokens=6, seed=3, prompt_logprobs=True)
        measured = gap(tc, base, PROMPTS)
        print(f"base after a loud adapter: max |sampler - trainer| = {measured:.2e}")
        assert measured <= PARITY
        assert np.abs(prompt_scores(tc, PROMPTS) - base_before).max() <= PARITY
        tc.delete_adapter("loud")


def test_an_engine_that_stops_answering_is_replaced(lora_sampled: Service) -> None:
    """SIGSTOP the engine (a hung process: it answers nothing, and is not dead): the next
    sample fails within the deadline with a retryable 503, ready and info show the engine
    restarting, and it comes back serving the current step; sampling and a sync work."""
    with lora_sampled.client() as tc:
        before = tc.info().samplers
        assert before is not None
        (engine,) = before.engines
        assert engine.status == "ready" and engine.pid is not None
        os.kill(engine.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(f"{lora_sampled.url}/v1/sample",
                       json={"prompts": [[1, 2, 3]], "max_tokens": 2}, timeout=120)  # fmt: skip
        waited = time.monotonic() - t0
        assert r.status_code == 503 and "did not answer" in r.text, r.text
        assert SAMPLER_TIMEOUT_S <= waited < SAMPLER_TIMEOUT_S + 15, waited
        ready = httpx.get(f"{lora_sampled.url}/v1/ready", timeout=10).json()
        assert ready["status"] == "ready" and ready["samplers"] == {"restarting": 1}, ready
        now = tc.info().samplers
        assert now is not None and now.engines[0].status == "restarting"
        assert "did not answer" in (now.engines[0].last_error or "")
        deadline = time.monotonic() + 240
        while tc.info().samplers.engines[0].status != "ready":  # type: ignore[union-attr]
            assert time.monotonic() < deadline, tc.info().samplers
            time.sleep(1)
        back = tc.info().samplers.engines[0]  # type: ignore[union-attr]
        assert back.pid != engine.pid and back.restarts == engine.restarts + 1
        assert back.step == tc.info().step
        assert httpx.get(f"{lora_sampled.url}/v1/ready", timeout=10).json()["samplers"] == {
            "ready": 1
        }
        result = tc.sample(PROMPTS, n=2, max_tokens=4, seed=2)
        assert gap(tc, result, PROMPTS) <= PARITY
        assert tc.sync_weights().samplers == 1
