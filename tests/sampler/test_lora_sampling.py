"""LoRA adapters served by the sampler engines (vLLM's LoRA support), through the real service.

The check is parity: what vLLM reports for an adapter (sampled tokens and prompt tokens)
equals the trainer's ``/v1/logprobs`` with that adapter, in fp32, after the adapter has
trained far enough from the base that serving the base (or another adapter) would show.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from trainctl.api import ConflictError, NotFoundError

from helpers.parity import PARITY, PROMPTS, WINDOW, gap, prompt_scores
from helpers.servicekit import Service
from helpers.snapshots import SCORED, datum, snapshots_hold_through_the_window

PROBE = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
APART = 1e-2
"""How far a trained adapter's log-probs are from the base's (measured: above 0.1)."""


def _train(tc: Any, adapter: str, batch: list[list[int]], steps: int) -> int:
    rows = [{"tokens": p, "loss_mask": [1] * len(p)} for p in batch]
    for _ in range(steps):
        tc.forward_backward(rows, adapter=adapter)
        step = tc.optim_step(lr=5e-2, adapter=adapter)
        assert step.warnings == [], step.warnings
    return int(step.step)


def test_adapters_are_sampled_with_their_own_weights(lora_sampled: Service) -> None:
    with lora_sampled.client() as tc:
        tc.create_adapter("one", rank=8, alpha=16.0)
        tc.create_adapter("two", rank=4, alpha=8.0, targets=["attn", "mlp"])
        samplers = tc.info().samplers
        assert samplers is not None and samplers.adapters == {"one": 0, "two": 0}
        # Created: B = 0, so each adapter samples as the base does.
        base = prompt_scores(tc, PROBE)
        assert np.abs(prompt_scores(tc, PROBE, "one") - base).max() <= PARITY

        assert _train(tc, "one", PROBE, 3) == 3
        assert _train(tc, "two", PROBE[::-1], 2) == 2
        samplers = tc.info().samplers
        assert samplers is not None and samplers.adapters == {"one": 3, "two": 2}
        one, two = prompt_scores(tc, PROBE, "one"), prompt_scores(tc, PROBE, "two")
        assert np.abs(one - base).max() > APART and np.abs(two - base).max() > APART
        assert np.abs(one - two).max() > APART
        assert np.abs(prompt_scores(tc, PROBE) - base).max() == 0.0, "the base moved"

        for adapter in ("one", "two", None):
            r = tc.sample(PROMPTS, n=2, max_tokens=8, seed=5, prompt_logprobs=True,
                          adapter=adapter)  # fmt: skip
            assert r.step == {"one": 3, "two": 2, None: 0}[adapter]
            measured = gap(tc, r, PROMPTS, adapter)
            print(f"adapter {adapter}, fp32: max |sampler - trainer| log-prob = {measured:.2e}")
            assert measured <= PARITY

        with pytest.raises(ConflictError, match="adapter 'one' of step 3"):
            tc.sample(PROMPTS, max_tokens=2, adapter="one", expected_step=2)
        with pytest.raises(NotFoundError, match="'three'"):
            tc.sample(PROMPTS, max_tokens=2, adapter="three")

        tc.delete_adapter("two")
        samplers = tc.info().samplers
        assert samplers is not None and samplers.adapters == {"one": 3}
        with pytest.raises(NotFoundError, match="'two'"):
            tc.sample(PROMPTS, max_tokens=2, adapter="two")
        assert np.abs(prompt_scores(tc, PROBE, "one") - one).max() == 0.0


def test_base_and_adapter_requests_in_flight_together_keep_their_weights(
    lora_sampled: Service,
) -> None:
    """vLLM has been seen applying an adapter to base requests batched with it: an engine here
    serves one request (one adapter, or the base) at a time, so requests sent together still
    each get their own weights."""
    with lora_sampled.client() as tc:
        if "mix" not in {a.name for a in tc.list_adapters().adapters}:
            tc.create_adapter("mix", rank=8)
            _train(tc, "mix", PROBE, 2)
        want = {None: prompt_scores(tc, PROBE), "mix": prompt_scores(tc, PROBE, "mix")}
        assert np.abs(want[None] - want["mix"]).max() > APART
        got: list[tuple[str | None, np.ndarray]] = []

        def score(adapter: str | None) -> None:
            with lora_sampled.client() as own:
                got.append((adapter, prompt_scores(own, PROBE, adapter)))

        threads = [threading.Thread(target=score, args=(a,)) for a in [None, "mix"] * 4]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(got) == 8
        for adapter, scores in got:
            assert np.abs(scores - want[adapter]).max() <= PARITY, adapter
        tc.delete_adapter("mix")


def test_a_tinker_lora_client_samples_with_its_adapter(lora_sampled: Service) -> None:
    """The real SDK: a LoRA model's sampling client samples its adapter at the step it was
    made at, and a saved sampler path samples it. Made at step 3, it keeps doing so after
    step 5, beside a client made then (the window of three versions); after step 6 it is
    refused with a 410."""
    from trainctl.service.tinker.state import native_name

    sc = tinker.ServiceClient(base_url=lora_sampled.url, api_key="tml-local")
    try:
        base_model = sc.get_server_capabilities().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=base_model, rank=8).result()
        adapter = native_name(tc.model_id, None)
        scored = SCORED
        for _ in range(3):
            tc.forward_backward([datum(scored)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        lps = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
        with lora_sampled.client() as native:
            trainer = native.logprobs([scored], adapter=adapter).logprobs[0]
            base = native.logprobs([scored]).logprobs[0]
        assert np.abs(np.asarray(lps[1:]) - np.asarray(trainer[1:])).max() <= PARITY
        assert np.abs(np.asarray(lps[1:]) - np.asarray(base[1:])).max() > APART

        r = sampler.sample(
            types.ModelInput.from_ints(scored[:4]), 2,
            types.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
        ).result()  # fmt: skip
        with lora_sampled.client() as native:
            for s in r.sequences:
                own = native.logprobs([scored[:4] + s.tokens], adapter=adapter).logprobs[0]
                assert np.abs(np.asarray(own[4:]) - np.asarray(s.logprobs)).max() <= PARITY

        path = tc.save_weights_for_sampler("lora-sampled").result().path
        by_path = sc.create_sampling_client(model_path=path).result()
        again = by_path.compute_logprobs(types.ModelInput.from_ints(scored)).result()
        assert np.abs(np.asarray(again[1:]) - np.asarray(lps[1:])).max() <= PARITY

        # Steps 3 and 5 of the adapter after its step 5; then step 3's 410.
        with lora_sampled.client() as native:
            out = snapshots_hold_through_the_window(tc, native, adapter, window=WINDOW)
        assert out["steps"] == (3, 5), out
    finally:
        sc.close("success").result()


def _files(d: Any) -> dict[str, bytes]:
    """Every file under directory ``d``, by its path there, with its bytes."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_two_tinker_runs_each_save_final_and_load_their_own(lora_sampled: Service) -> None:
    """What every recipe ends with, by two runs on one service: each saves its state and its
    sampler weights as 'final'. Each name is its run's: the first run's files are the same
    bytes after the second's save, and each path loads and samples its own run's adapter. A
    load restores only the loading client's adapter: the other run's step and log-probs do
    not move (0.0)."""
    from trainctl.service.tinker.state import native_name

    sc = tinker.ServiceClient(base_url=lora_sampled.url, api_key="tml-local")
    native = lora_sampled.client()
    names: dict[str, str] = {}  # each run's model id: its adapter's native name
    try:
        base_model = sc.get_server_capabilities().supported_models[0].model_name
        runs = [sc.create_lora_training_client(base_model=base_model, rank=8) for _ in "ab"]
        a, b = (r.result() for r in runs)
        names.update({tc.model_id: native_name(tc.model_id, None) for tc in (a, b)})

        def steps(tc: Any, tokens: list[int], n: int, lr: float = 5e-2) -> None:
            for _ in range(n):
                tc.forward_backward([datum(tokens)], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=lr)).result()

        def trainer(tc: Any) -> np.ndarray:
            return np.asarray(native.logprobs([SCORED], adapter=names[tc.model_id]).logprobs[0])

        def step_of(tc: Any) -> int:
            return next(
                x.step for x in native.list_adapters().adapters if x.name == names[tc.model_id]
            )

        def saved_files() -> dict[str, bytes]:  # every checkpoint and export on the service
            data = lora_sampled.data_dir
            return {f"{d}/{k}": v for d in ("checkpoints", "exports")
                    for k, v in _files(data / d).items()}  # fmt: skip

        steps(a, SCORED, 2)
        a_state = a.save_state("final").result().path
        a_sampler = a.save_weights_for_sampler("final").result().path
        a_files, a_want = saved_files(), trainer(a)
        assert any(k.startswith("exports/") for k in a_files) and len(a_files) > 2

        # Not so far that SCORED's log-probs fall to -50, where fp32 rounding of the logits
        # alone is 1e-4 (seen once: 1.5e-4 at a log-prob of -32).
        steps(b, PROBE[0], 3, lr=1e-2)
        b_state = b.save_state("final").result().path  # no 409: a's 'final' is a's
        b_sampler = b.save_weights_for_sampler("final").result().path
        b_want = trainer(b)
        after = saved_files()
        changed = [k for k, v in a_files.items() if after.get(k) != v]
        assert changed == [], f"the second run's saves changed or removed {changed}"
        assert np.abs(a_want[1:] - b_want[1:]).max() > APART

        for path, want in ((a_sampler, a_want), (b_sampler, b_want)):
            client = sc.create_sampling_client(model_path=path).result()
            got = client.compute_logprobs(types.ModelInput.from_ints(SCORED)).result()
            assert np.abs(np.asarray(got[1:]) - want[1:]).max() <= PARITY, path

        steps(a, SCORED, 2)  # a moves on; b's state is what a load must not touch
        b_at, b_step = trainer(b), step_of(b)
        a_moved = trainer(a)
        assert np.abs(a_moved[1:] - a_want[1:]).max() > APART
        again = sc.create_training_client_from_state_with_optimizer(a_state).result()
        assert native_name(again.model_id, None) not in names.values()  # an adapter of its own
        names[again.model_id] = native_name(again.model_id, None)
        assert np.abs(trainer(again)[1:] - a_want[1:]).max() <= 1e-6
        assert step_of(again) == 2
        a.load_state(b_state).result()  # a takes b's saved state into its own adapter
        assert np.abs(trainer(a)[1:] - b_want[1:]).max() <= 1e-6 and step_of(a) == 3
        assert step_of(b) == b_step and np.abs(trainer(b) - b_at).max() == 0.0
        assert step_of(again) == 2
    finally:
        for name in names.values():  # a failed case leaves nothing for the next
            with contextlib.suppress(NotFoundError):
                native.delete_adapter(name)
        native.close()
        sc.close("success").result()
