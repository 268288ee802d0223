"""Sampling from the policy being trained, through the real service: vLLM engines fed the
ranks' weights from memory, tagged with the step of those weights.

Parity is the core check: the log-prob vLLM reports for each token it sampled (and for each
prompt token) equals the trainer's ``/v1/logprobs`` of the same sequence, in fp32, before and
after a step. A sync that did not happen, loaded the wrong tensors or mapped a name wrongly
shows up there.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainctl.api import (
    ConflictError,
    GoneError,
    InvalidRequestError,
    NotReadyError,
)
from trainctl.clients._base import RetryPolicy
from trainctl.workers.sampler.vllm_backend.folders import ADAPTER_DIR_PREFIX, CONFIG_DIR_PREFIX

import one_engine_cases as cases
from helpers.parity import PARITY, PROMPTS, WINDOW, gap, prompt_scores
from helpers.servicekit import START_TIMEOUT_S, Service, fresh_home
from helpers.snapshots import snapshots_hold_through_the_window


def test_sampler_logprobs_equal_the_trainers(sampled: Service) -> None:
    with sampled.client() as tc:
        info = tc.info()
        assert info.samplers is not None and info.samplers.step == info.step
        assert [e.status for e in info.samplers.engines] == ["ready", "ready"]
        r = tc.sample(PROMPTS, n=3, max_tokens=12, temperature=1.0, seed=7, prompt_logprobs=True)
        assert r.step == info.step
        assert all(len(s.completions) == 3 for s in r.samples)
        measured = gap(tc, r, PROMPTS)
        print(f"embedded model, fp32: max |sampler - trainer| log-prob = {measured:.2e}")
        assert measured <= PARITY
        again = tc.sample(PROMPTS, n=3, max_tokens=12, temperature=1.0, seed=7)
        assert [c.tokens for s in again.samples for c in s.completions] == [
            c.tokens for s in r.samples for c in s.completions
        ], "equal seeds must give equal samples"


def test_the_engines_leave_the_home_directory_empty(sampled: Service) -> None:
    """The engines started, loaded weights and sampled; what they cache (vLLM keeps its model
    inspection under ``XDG_CACHE_HOME``) went under the data directory, not the fresh HOME."""
    with sampled.client() as tc:
        tc.sample(PROMPTS[:1], max_tokens=2)
    home = Path(str(sampled.env["HOME"]))
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == []


def test_a_step_reaches_the_samplers_tagged_with_its_step(sampled: Service) -> None:
    """``sync after_step``: the step's result comes back once the samplers hold it, and
    every sample says which step produced it."""
    with sampled.client() as tc:
        before = tc.info().step
        probe = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
        old = prompt_scores(tc, probe)
        batch = [{"tokens": p, "loss_mask": [1] * len(p)} for p in probe]
        step = tc.train_batch(batch)
        assert step.step == before + 1 and step.warnings == []
        info = tc.info()
        assert info.samplers is not None and info.samplers.step == step.step
        assert info.samplers.last_sync is not None and info.samplers.last_sync.bytes > 0
        new = prompt_scores(tc, probe)
        assert np.abs(new - old).max() > 1e-3, "the samplers still serve the old weights"
        r = tc.sample(PROMPTS, n=2, max_tokens=8, seed=3, prompt_logprobs=True)
        assert r.step == step.step
        assert gap(tc, r, PROMPTS) <= PARITY


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1024}, "max_tokens"),
        ({"n": 65}, "n"),
        ({"prompts": [[1, 2], [3, 512]]}, "prompts[1][1]"),
        ({"prompts": [[1, -1]]}, "prompts[0][1]"),
        ({"prompts": [[1] * 1020], "max_tokens": 8}, "prompts[0]"),
        ({"prompts": [[]]}, "prompts[0]"),
        ({"stop_token_ids": [9999]}, "stop_token_ids[0]"),
        (
            {"stop": ["\n\n"]},
            "stop: string stops need the model's tokenizer, and this service "
            "has none: start it with --init-hf DIR",
        ),  # the embedded model has no tokenizer
        ({"stop": [""]}, "stop[0]"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_sampling_parameters_are_422_naming_the_field(
    sampled: Service, params: dict[str, Any], field: str
) -> None:
    """The gateway refuses them (the SDK's own check is bypassed: raw HTTP), and the samplers
    are untouched: the same seeded request answers as before."""
    import httpx

    body = {"prompts": [[1, 2, 3]], "max_tokens": 4, **params}
    with sampled.client() as tc:
        ref = tc.sample([[1, 2, 3]], max_tokens=4, seed=11)
        got = httpx.post(f"{sampled.url}/v1/sample", json=body, timeout=60)
        assert got.status_code == 422, got.text
        assert got.json()["message"].startswith(field) or field in got.text, got.text
        after = tc.sample([[1, 2, 3]], max_tokens=4, seed=11)
        assert after.samples == ref.samples and after.step == ref.step


def _engine_folders() -> set[Path]:
    """The sampler engines' folders on this machine: config (temp dir), adapters (memory)."""
    roots = (Path(tempfile.gettempdir()), Path("/dev/shm"))
    prefixes = (CONFIG_DIR_PREFIX, ADAPTER_DIR_PREFIX)
    return {p for r in roots for p in r.glob("trainctl-*") if p.name.startswith(prefixes)}


def test_a_killed_sampler_is_recreated_with_the_current_weights(sampled: Service) -> None:
    """SIGKILL an engine while it serves: that request fails with a retryable 503, ``info``
    shows the engine restarting, and it comes back holding the step the service is at."""
    no_retry = RetryPolicy(max_retries=0)
    with sampled.client() as tc, sampled.client(retry=no_retry) as raw:
        step = tc.info().step
        errors: list[BaseException] = []

        import threading

        def long_request() -> None:
            try:
                raw.sample([[1, 2, 3]] * 64, n=8, max_tokens=900, temperature=1.0)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        busy = None
        while busy is None and time.monotonic() < deadline:
            engines = tc.info().samplers.engines  # type: ignore[union-attr]
            busy = next((e for e in engines if e.in_flight), None)
            time.sleep(0.1)
        assert busy is not None and busy.pid is not None
        folders = _engine_folders()
        os.kill(busy.pid, signal.SIGKILL)
        t.join(120)
        assert len(errors) == 1 and isinstance(errors[0], NotReadyError), errors
        assert errors[0].status == 503
        engine = tc.info().samplers.engines[busy.index]  # type: ignore[union-attr]
        assert engine.status in ("restarting", "ready") and engine.last_error
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            engine = tc.info().samplers.engines[busy.index]  # type: ignore[union-attr]
            if engine.status == "ready":
                break
            time.sleep(1)
        assert engine.status == "ready" and engine.restarts == 1 and engine.step == step
        assert engine.pid != busy.pid
        # The killed engine's folders (its config; its adapter files, in memory) are gone.
        gone = folders - _engine_folders()
        assert len(gone) == 2 and all(str(busy.pid) in p.name for p in gone), gone
        # Both engines serve the current weights: sample until the recreated one answered.
        seen = set()
        for _ in range(8):
            r = tc.sample(PROMPTS, n=2, max_tokens=6, seed=1)
            seen.add(r.sampler)
            assert r.step == step and gap(tc, r, PROMPTS) <= PARITY
        assert busy.index in seen


def test_a_string_stop_ends_a_completion_where_its_text_appears(qwen3_manual: Service) -> None:
    """The model's directory holds a tokenizer (``word_tokenizer``: every even id decodes to
    a paragraph break): a completion sampled with ``stop: ["\n\n"]`` is the one sampled
    without it (the same seed), cut after its first even id, and says it stopped; through the
    native API and through Tinker's ``SamplingParams.stop``."""
    import tinker
    from tinker import types

    prompts = [[1, 2, 3, 4, 5], [100, 101, 7], [9, 11, 13]]
    with qwen3_manual.client() as tc:
        assert tc.info().limits.tokenizer
        free = tc.sample(prompts, n=2, max_tokens=12, seed=21)
        cut = tc.sample(prompts, n=2, max_tokens=12, seed=21, stop=["\n\n"])
    firsts = []
    for whole, stopped in zip(free.samples, cut.samples, strict=True):
        for a, b in zip(whole.completions, stopped.completions, strict=True):
            first = next((i for i, t in enumerate(a.tokens) if t % 2 == 0), None)
            assert first is not None and a.finish_reason == "length", a
            assert b.tokens == a.tokens[: first + 1] and b.finish_reason == "stop", (a, b)
            assert b.logprobs == pytest.approx(a.logprobs[: first + 1], abs=1e-6)
            firsts.append(first)
    assert max(firsts) >= 1, firsts  # some completion ran on past its first token

    sc = tinker.ServiceClient(base_url=qwen3_manual.url, api_key="tml-local")
    try:
        name = sc.get_server_capabilities().supported_models[0].model_name
        sampler = sc.create_sampling_client(base_model=name)
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=21, stop=["\n\n"])
        r = sampler.sample(types.ModelInput.from_ints(prompts[0]), 2, params).result()
        for seq, want in zip(r.sequences, cut.samples[0].completions, strict=True):
            assert seq.tokens == want.tokens and seq.stop_reason == "stop", seq
    finally:
        sc.close("success").result()


def test_a_tinker_snapshot_on_one_engine_gets_its_step_swapped_in(qwen3_manual: Service) -> None:
    """Full fine-tuning through the real ``tinker`` SDK with one sampler engine (Qwen3 at
    tp2): the engine holds one version at a time, so a request of the step-0 client loads step
    0's weights from the window's host copies in its turn, and one of the step-2 client loads
    step 2's back; each gets its own step's log-probs; after step 3, step 0's client gets the
    410. The base is restored and synced after (the next test starts from it)."""
    import tinker

    with qwen3_manual.client() as native:
        native.save_checkpoint("qwen3-base")
        sc = tinker.ServiceClient(base_url=qwen3_manual.url, api_key="tml-local")
        try:
            training = sc.create_lora_training_client(
                base_model=native.info().model_name, rank=0
            ).result()
            out = snapshots_hold_through_the_window(training, native, None, window=WINDOW)
            assert out["steps"] == (0, 2), out
        finally:
            sc.close("success").result()
            assert native.load_checkpoint("qwen3-base").step == 0
            assert native.sync_weights().step == 0  # manual: a load serves nothing until then


def test_manual_sync_and_a_family_at_tp2(qwen3_manual: Service) -> None:
    """Qwen3 (tied embeddings, wide heads) from two TP shards: parity at the start; after a
    step the samplers keep the old weights until ``sync_weights``, and say so. Then the window
    of versions on one engine: a request for the older step gets it (swapped in), the next for
    the newest gets that, and once the older step leaves the window it is a 410."""
    prompts = [[1, 2, 3, 4, 5], [100, 101, 7]]
    with qwen3_manual.client() as tc:
        r0 = tc.sample(prompts, n=2, max_tokens=10, seed=5, prompt_logprobs=True)
        assert r0.step == 0
        measured = gap(tc, r0, prompts)
        print(f"Qwen3 tiny at tp=2, fp32: max |sampler - trainer| log-prob = {measured:.2e}")
        assert measured <= PARITY
        old = prompt_scores(tc, prompts)
        batch = [{"tokens": p, "loss_mask": [1] * len(p)} for p in prompts]
        assert tc.train_batch(batch).step == 1
        assert tc.sample(prompts, max_tokens=2).step == 0  # manual: not synced yet
        assert np.abs(prompt_scores(tc, prompts) - old).max() == 0.0
        with pytest.raises(ConflictError, match="step 0"):
            tc.sample(prompts, max_tokens=2, expected_step=1)
        synced = tc.sync_weights()
        assert synced.step == 1 and synced.samplers == 1 and synced.bytes > 0
        r1 = tc.sample(prompts, n=2, max_tokens=10, seed=5, prompt_logprobs=True, expected_step=1)
        assert r1.step == 1 and gap(tc, r1, prompts) <= PARITY
        new = prompt_scores(tc, prompts)
        assert np.abs(new - old).max() > 1e-3
        for _ in range(2):
            assert np.abs(prompt_scores(tc, prompts, step=0) - old).max() <= PARITY
            assert np.abs(prompt_scores(tc, prompts) - new).max() <= PARITY
        served = tc.info().samplers
        assert served is not None and served.versions == [0, 1], served
        for step in range(2, WINDOW + 1):  # step 0 leaves the window
            assert tc.train_batch(batch).step == step and tc.sync_weights().step == step
        with pytest.raises(GoneError, match=r"step 0 .* oldest served is step 1"):
            tc.sample(prompts, max_tokens=2, step=0)
        assert np.abs(prompt_scores(tc, prompts, step=1) - new).max() <= PARITY


@pytest.mark.parametrize("layout", ["tp2 collective", "pp2 object store"])
def test_a_sharded_trainer_feeds_its_engines_exactly(
    layout: str, request: pytest.FixtureRequest
) -> None:
    """After a sync streamed from the ranks that own the weights (two TP shards over the
    collective; two pipeline stages through the object store): greedy samples and prompt and
    sample log-probs equal a fresh engine's, loaded with the exported weights of that step
    (fp32 on a CPU: 0.0)."""
    service: Service = request.getfixturevalue(
        "qwen3_manual" if layout.startswith("tp2") else "sampled"
    )
    ask = {"prompts": PROMPTS, "n": 1, "max_tokens": 8, "temperature": 0.0,
           "logprobs": True, "prompt_logprobs": True}  # fmt: skip
    with service.client() as tc:
        stepped = tc.train_batch([{"tokens": p, "loss_mask": [1] * len(p)} for p in PROMPTS])
        synced = tc.sync_weights()
        got = tc.sample(**ask)
        exported = tc.export_hf(f"{layout.split()[0]}-exact")
    assert stepped.warnings == [] and synced.samplers >= 1
    assert synced.convert_s is not None and synced.rank_peak_bytes is not None
    assert exported.step == got.step == synced.step > 0
    with mp.get_context("spawn").Pool(1) as pool:
        fresh = pool.apply_async(
            cases.fresh_engine_sample, (str(service.data_dir / exported.path), got.step, ask)
        ).get(timeout=600)
    tokens, lps = cases.flat_result(got)
    assert len(lps) > 30 and tokens == fresh[0], (tokens, fresh[0])
    assert max(abs(a - b) for a, b in zip(lps, fresh[1], strict=True)) == 0.0


def test_sampling_refuses_what_the_sampler_cannot_do_and_changes_nothing(
    qwen3_manual: Service,
) -> None:
    with qwen3_manual.client() as tc:
        step = tc.info().step
        with pytest.raises(InvalidRequestError, match="max_seq_len"):
            tc.sample([list(range(100))], max_tokens=64)
        with pytest.raises(InvalidRequestError, match=r"return_routes: .* --sampler-routes"):
            tc.sample([[1, 2, 3]], max_tokens=2, return_routes=True)
        assert tc.info().step == step


def test_routes_from_cpu_samplers_are_refused_at_start_saying_why(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vLLM captures routed experts only in its Model Runner V2, which needs Triton; its CPU
    build has none. A MoE service asked for them on CPU samplers stops, saying so, before it
    builds a rank (measured without the check: vLLM's own start-up fails with "Model Runner V2
    requires Triton")."""
    data = tmp_path_factory.mktemp("routes-on-cpu")
    engine = data / "engine.json"
    engine.write_text(json.dumps({"model": {"family": "qwen3_moe", "num_experts": 4}}))
    svc = Service(data, f"--engine-config={engine}", "--samplers=1", "--sampler-routes=true",
                  start_timeout_s=START_TIMEOUT_S, env=fresh_home(data))  # fmt: skip
    with pytest.raises(RuntimeError):
        svc.start()
    assert "sampler_routes: vLLM captures routes only in its Model Runner V2" in svc.log(), (
        svc.log()[-2000:]
    )
    assert "rank(s):" not in svc.log(), "the ranks were built before the refusal"
