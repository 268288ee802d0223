"""No request can jam a sampler engine, a stopped engine is replaced, and base requests on an
adapter service get no adapter's weights: the live service (``lora_sampled``: one vLLM engine,
LoRA enabled, a short call deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import numpy as np
import pytest

from helpers.parity import (
    MAX_QUEUED,
    MAX_QUEUED_TOKENS,
    PARITY,
    PROMPTS,
    SAMPLER_TIMEOUT_S,
    gap,
    prompt_scores,
)
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


def test_a_seed_whose_children_overflow_is_a_422_and_bystanders_answer(
    lora_sampled: Service,
) -> None:
    """vLLM seeds child i of a request with seed + i: 2^64 - 1 with n = 2 overflows inside the
    engine's step, failing every request of that step. It is refused at the gateway (native
    and Tinker), while requests sent beside it answer 200; 2^64 - 1 with n = 1 is legal. A
    temperature past vLLM's limit is a 422 naming it, not a 500 from the engine."""
    from concurrent.futures import ThreadPoolExecutor

    top = 2**64 - 1
    url = lora_sampled.url
    bystander = {"prompts": [[1, 2, 3], [4, 5]], "max_tokens": 6, "n": 2, "seed": 3}
    bad = {"prompts": [[1, 2, 3]], "max_tokens": 6, "n": 2, "seed": top}
    tinker = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "seed": top}, "num_samples": 2, "base_model": "x",
    }  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        sent = [pool.submit(httpx.post, f"{url}/v1/sample", json=bystander, timeout=120)
                for _ in range(4)]  # fmt: skip
        refused = [pool.submit(httpx.post, f"{url}/v1/sample", json=bad, timeout=120)
                   for _ in range(2)]  # fmt: skip
        tinkered = pool.submit(httpx.post, f"{url}/api/v1/asample", json=tinker, timeout=120,
                               headers={"x-api-key": "tml-x"})  # fmt: skip
        answers = [f.result() for f in sent]
        for f in refused:
            r = f.result()
            assert r.status_code == 422 and r.json()["message"].startswith("seed"), r.text
        r = tinkered.result()
        assert r.status_code in (400, 422) and "seed" in r.text, r.text
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert len({str(a.json()["samples"]) for a in answers}) == 1  # the same seed, the same
    legal = httpx.post(f"{url}/v1/sample", json={**bad, "n": 1}, timeout=120)
    assert legal.status_code == 200, legal.text
    hot = httpx.post(f"{url}/v1/sample", json={**bystander, "temperature": 3.0}, timeout=60)
    assert hot.status_code == 422 and hot.json()["message"].startswith("temperature"), hot.text


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


def test_samples_past_the_bound_answer_429_at_once_and_the_engine_keeps_serving(
    lora_sampled: Service,
) -> None:
    """40 samples sent together over plain HTTP (no SDK retries) to samplers that hold
    ``MAX_QUEUED``: the ones past the bound answer 429 with Retry-After without waiting, the
    rest 200. A request that alone asks for more than ``MAX_QUEUED_TOKENS`` is a 422 naming
    ``prompts``. Then a sample and a sync answer as before."""
    body = {"prompts": [[1, 2, 3], [4, 5, 6]], "n": 4, "max_tokens": 16}

    async def burst() -> list[tuple[int, float, httpx.Headers, str]]:
        async with httpx.AsyncClient(base_url=lora_sampled.url, timeout=300) as http:

            async def one() -> tuple[int, float, httpx.Headers, str]:
                t0 = time.monotonic()
                r = await http.post("/v1/sample", json=body)
                return r.status_code, time.monotonic() - t0, r.headers, r.text

            return await asyncio.gather(*(one() for _ in range(40)))

    answers = asyncio.run(burst())
    codes = sorted({code for code, *_ in answers})
    limited = [(s, h, t) for code, s, h, t in answers if code == 429]
    assert codes == [200, 429], [(c, t[:200]) for c, _, _, t in answers if c not in (200, 429)]
    assert len(limited) >= 40 - 2 * MAX_QUEUED, len(limited)
    for seconds, headers, text in limited:
        assert seconds < 5 and "retry-after" in headers and "bound" in text, (seconds, text)

    big = {"prompts": [[1, 2, 3]] * 50, "n": 16, "max_tokens": 64}  # 16 x 50 x 67 tokens
    r = httpx.post(f"{lora_sampled.url}/v1/sample", json=big, timeout=60)
    assert r.status_code == 422 and "prompts" in r.text, r.text
    assert str(MAX_QUEUED_TOKENS) in r.text, r.text
    with lora_sampled.client() as tc:
        assert tc.sample([[1, 2, 3]], max_tokens=2).samples
        tc.sync_weights()


def test_a_sync_goes_ahead_of_waiting_samples_and_one_past_its_queue_timeout_never_runs(
    lora_sampled: Service,
) -> None:
    """Eight long samples sent together hold the one engine (two run at once: the fixture's
    ``--sampler-concurrency``); a sync sent once they are all in completes before all but the
    two that had the engine already (in arrival order, a sync would wait for all eight). Then a
    sample asking to wait at most 0.2 s, sent behind three long ones, answers a retryable 503
    saying it did not run, and the engine serves the next sample."""
    long = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8]] * 4, "n": 4, "max_tokens": 150}

    async def in_flight(http: httpx.AsyncClient) -> int:
        info = (await http.get("/v1/info")).json()
        return int(info["samplers"]["engines"][0]["in_flight"])

    async def main() -> tuple[float, list[tuple[float, int]], httpx.Response]:
        async with httpx.AsyncClient(base_url=lora_sampled.url, timeout=300) as http:
            ended: list[tuple[float, int]] = []

            async def one(seed: int) -> None:
                r = await http.post("/v1/sample", json={**long, "seed": seed})
                ended.append((time.monotonic(), r.status_code))

            samples = [asyncio.create_task(one(i)) for i in range(8)]
            deadline = time.monotonic() + 60
            while await in_flight(http) < 8:
                assert time.monotonic() < deadline and not any(t.done() for t in samples)
                await asyncio.sleep(0.01)
            with lora_sampled.client() as tc:
                await asyncio.to_thread(tc.sync_weights)
            synced = time.monotonic()
            await asyncio.gather(*samples)

            ahead = [asyncio.create_task(one(10 + i)) for i in range(3)]
            while await in_flight(http) < 3:
                await asyncio.sleep(0.01)
            short = {"prompts": [[1, 2, 3]], "max_tokens": 2, "queue_timeout_s": 0.2}
            late = await http.post("/v1/sample", json=short)
            await asyncio.gather(*ahead)
            return synced, ended, late

    synced, ended, late = asyncio.run(main())
    assert [code for _, code in ended] == [200] * 11, ended
    before = sum(t < synced for t, _ in ended[:8])
    assert before <= 2, f"the sync waited for {before} of the 8 samples queued before it"
    assert late.status_code == 503 and "did not run" in late.text, late.text
    with lora_sampled.client() as tc:
        assert tc.sample([[1, 2, 3]], max_tokens=2).samples


def test_a_tinker_asample_past_the_bound_is_a_429_at_the_call(lora_sampled: Service) -> None:
    """While the samplers hold ``MAX_QUEUED`` samples, Tinker's ``asample`` answers 429 with
    Retry-After at once (the SDK retries it), instead of a future that waits; once they are
    done it answers a future again.

    The samplers are filled without a race against the engine: two long samples take both of
    the engine's turns (``--sampler-concurrency 2``) before ten short ones queue behind them,
    so none can finish while the rest are still being admitted, however loaded the machine."""
    long = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8]] * 8, "n": 16, "max_tokens": 150}
    short = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8]], "max_tokens": 4}

    async def main() -> tuple[httpx.Response, float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=lora_sampled.url, timeout=300) as http:
            name = (await http.get("/v1/info")).json()["model_name"]
            tinker = {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2}, "base_model": name,
            }  # fmt: skip
            key = {"x-api-key": "tml-bound"}

            async def held_until(held: list[asyncio.Task[httpx.Response]], count: int) -> None:
                deadline = time.monotonic() + 60
                while (await http.get("/v1/info")).json()["samplers"]["engines"][0][
                    "in_flight"
                ] < count:
                    done = [t.result().text for t in held if t.done()]
                    assert not done, f"a held sample answered before the bound was full: {done}"
                    assert time.monotonic() < deadline, f"fewer than {count} held after 60 s"
                    await asyncio.sleep(0.01)

            t_held = time.monotonic()
            held = [asyncio.create_task(http.post("/v1/sample", json={**long, "seed": i}))
                    for i in range(2)]  # fmt: skip
            await held_until(held, 2)
            held += [
                asyncio.create_task(http.post("/v1/sample", json={**short, "seed": i}))
                for i in range(MAX_QUEUED - 2)
            ]
            await held_until(held, MAX_QUEUED)
            t0 = time.monotonic()
            full = await http.post("/api/v1/asample", json=tinker, headers=key)
            waited = time.monotonic() - t0
            ended = await asyncio.gather(*held)
            held_s = time.monotonic() - t_held
            assert [r.status_code for r in ended] == [200] * MAX_QUEUED, [r.text for r in ended]
            again = await http.post("/api/v1/asample", json=tinker, headers=key)
            return full, waited, held_s, again

    full, waited, held_s, again = asyncio.run(main())
    assert full.status_code == 429 and "retry-after" in full.headers, full.text
    # A future that waited for room would take about as long as the held samples did.
    assert waited < held_s / 3 and "bound" in full.text, (waited, held_s, full.text)
    assert again.status_code == 200 and "sample_sequence_ids" in again.json(), again.text


def test_a_sample_whose_client_leaves_is_stopped_in_the_engine(lora_sampled: Service) -> None:
    """A big sample (40 prompts x 16 completions x 60 tokens: seconds of engine work) whose
    HTTP client gives up after 1 s: the engine drops it, so a request that must have the engine
    to itself (prompt log-probs on a LoRA engine) sent right after answers at once instead of
    waiting for it to finish; the engine then samples as before."""
    body = {"prompts": [[1, 2, 3]] * 40, "n": 16, "max_tokens": 60, "seed": 1}
    with lora_sampled.client() as tc:
        ref = tc.sample([[1, 2, 3]], max_tokens=4, seed=11, prompt_logprobs=True)
        t0 = time.monotonic()
        full = httpx.post(f"{lora_sampled.url}/v1/sample", json=body, timeout=120)
        whole_s = time.monotonic() - t0  # what the client would have waited for
        assert full.status_code == 200, full.text
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{lora_sampled.url}/v1/sample", json=body, timeout=1.0)
            pytest.fail("the big sample answered within a second: it proves nothing")
        t0 = time.monotonic()
        alone = tc.sample([[1, 2, 3]], max_tokens=4, seed=11, prompt_logprobs=True)
        alone_s = time.monotonic() - t0
        print(f"big sample {whole_s:.1f} s; one alone after its client left {alone_s:.2f} s")
        # Not stopped, it would wait for the rest of the big one: ~0.85 of whole_s.
        assert alone_s < whole_s / 3, (alone_s, whole_s)
        assert alone.samples == ref.samples


def test_sixteen_concurrent_samples_of_the_base_and_two_adapters_equal_the_trainer(
    lora_sampled: Service,
) -> None:
    """Two adapters trained apart; then 16 samples sent at once, the base's and each adapter's
    interleaved, half of them with prompt log-probs (those run alone on a LoRA engine), the
    rest sharing the engine with their version's others: every sampled and prompt log-prob
    equals the trainer's with the adapter each named (base requests see no adapter)."""
    from concurrent.futures import ThreadPoolExecutor

    names = ("c1", "c2")
    with lora_sampled.client() as tc:
        for i, name in enumerate(names):
            tc.create_adapter(name, rank=8, alpha=64.0, seed=i)
            rows = [{"tokens": p, "loss_mask": [1] * len(p)} for p in PROMPTS if len(p) > 1]
            tc.forward_backward(rows, adapter=name)
            tc.optim_step(lr=1e-2, adapter=name)
        adapters = [None, *names]

        def one(i: int) -> tuple[str | None, float]:
            with lora_sampled.client() as own:  # 429 past the fixture's bound: it retries
                adapter = adapters[i % 3]
                r = own.sample(PROMPTS, n=2, max_tokens=6, seed=i, adapter=adapter,
                               prompt_logprobs=i % 2 == 0)  # fmt: skip
                return adapter, gap(own, r, PROMPTS, adapter)

        with ThreadPoolExecutor(16) as pool:
            gaps = list(pool.map(one, range(16)))
        for name in names:
            tc.delete_adapter(name)
    print("16 concurrent samples: max |sampler - trainer| by adapter:",
          {a: max(g for n, g in gaps if n == a) for a in adapters})  # fmt: skip
    assert max(g for _, g in gaps) <= PARITY, gaps
