"""Sampler routes (``--sampler-routes``, ``return_routes``) and the sampler start-up refusals:
the request and result fields, the engine's conversion of vLLM's captured routes (a stand-in
for vLLM's output object here: vLLM captures routes only on a GPU), and what the controller
refuses before vLLM would fail inside its own start-up."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trainctl.api import SampleRequest, SampleResult
from trainctl.workers.control.sampler_settings import SamplerSettings, check_engines
from trainctl.workers.engine.config import ConfigError, EngineConfig, LoraConfig, ModelConfig
from trainctl.workers.sampler.pool import PoolOptions
from trainctl.workers.sampler.vllm_backend.outputs import prompt_samples, token_steps, version_label
from trainctl.workers.sampler.vllm_backend.rules import env as engine_env

MOE = ModelConfig(family="qwen3_moe", num_experts=4)
QWEN3_5 = ModelConfig(
    family="qwen3_5", num_layers=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
)  # fmt: skip


def _settings(gpus: float, routes: bool = False) -> SamplerSettings:
    return SamplerSettings(pool=PoolOptions(num_samplers=1, num_gpus=gpus), routes=routes)


@pytest.mark.parametrize(
    ("model", "lora", "gpus", "routes", "words"),
    [
        (MOE, 2, 0, False, "samplers: vLLM's CPU build has no LoRA for mixture-of-experts"),
        (QWEN3_5, 0, 0, False, "samplers: vLLM's CPU build cannot load Qwen3.5"),
        (ModelConfig(), 0, 1, True, "sampler_routes: routes are captured for mixture-of-"),
        (MOE, 0, 0, True, "sampler_routes: vLLM captures routes only in its Model Runner V2"),
    ],
)  # fmt: skip
def test_what_the_engines_cannot_do_is_refused_naming_the_setting(
    model: ModelConfig, lora: int, gpus: float, routes: bool, words: str
) -> None:
    cfg = EngineConfig(model=model, lora=LoraConfig(max_adapters=lora))
    with pytest.raises(ConfigError, match="^" + words.replace("(", r"\(")):
        check_engines(cfg, _settings(gpus, routes))


@pytest.mark.parametrize(
    ("model", "lora", "gpus", "routes"),
    [(MOE, 2, 1, False), (QWEN3_5, 0, 1, False), (MOE, 0, 1, True), (MOE, 0, 0, False),
     (ModelConfig(), 2, 0, False)],
)  # fmt: skip
def test_what_the_engines_can_do_starts(
    model: ModelConfig, lora: int, gpus: float, routes: bool
) -> None:
    check_engines(EngineConfig(model=model, lora=LoraConfig(max_adapters=lora)),
                   _settings(gpus, routes))  # fmt: skip


def test_an_engine_that_captures_routes_runs_vllms_model_runner_v2() -> None:
    assert engine_env(True, 2, routes=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engine_env(True, 2)


def _vllm_output(prompt: list[int], tokens: list[int], routes: np.ndarray | None) -> object:
    """What vLLM's ``generate`` gives for one prompt and one completion, with captured routes
    (``CompletionOutput.routed_experts``: ``[tokens fed, layers, top_k]``)."""
    done = SimpleNamespace(token_ids=tokens, logprobs=None, finish_reason="length",
                           routed_experts=routes)  # fmt: skip
    return SimpleNamespace(outputs=[done], prompt_token_ids=prompt, prompt_logprobs=None)


def test_captured_routes_come_back_on_each_completion_and_over_json() -> None:
    prompt, tokens = [5, 6, 7], [8, 9]
    routes = np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2) % 4  # 3 + 2 - 1 tokens fed
    req = SampleRequest(prompts=[prompt], max_tokens=2, logprobs=False, return_routes=True)
    samples = prompt_samples(_vllm_output(prompt, tokens, routes), req, 3, True)
    got = samples.completions[0].routed_experts
    assert got == routes.tolist() and type(got[0][0][0]) is int
    result = SampleResult(samples=[samples], step=3, sampler=0, seconds=0.1)
    back = SampleResult.model_validate_json(result.model_dump_json())
    assert back.samples[0].completions[0].routed_experts == routes.tolist()
    plain = SampleRequest(prompts=[prompt], max_tokens=2, logprobs=False)
    assert prompt_samples(_vllm_output(prompt, tokens, routes), plain, 3, True).completions[0] \
        .routed_experts is None  # fmt: skip


@pytest.mark.parametrize(
    ("routes", "words"),
    [(None, "captured no routes"), (np.zeros((5, 2, 2), np.int16), r"shape \(5, 2, 2\), not \[4,"),
     (np.zeros((4, 2), np.int16), r"shape \(4, 2\)")],
)  # fmt: skip
def test_routes_that_do_not_cover_the_fed_tokens_are_an_error(
    routes: np.ndarray | None, words: str
) -> None:
    req = SampleRequest(prompts=[[5, 6, 7]], max_tokens=2, logprobs=False, return_routes=True)
    with pytest.raises(RuntimeError, match=words):
        prompt_samples(_vllm_output([5, 6, 7], [8, 9], routes), req, 3, True)


def _span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)  # vLLM's WeightVersionSpan


def test_each_token_gets_the_step_its_engine_labelled_it_with() -> None:
    """vLLM's spans become one step per token (a version change inside a completion shows),
    of the base or of an adapter's newest slot, as the engine labelled its steps; a pinned
    adapter request, or a completion vLLM labelled nothing, takes the request's step; a label
    that names no such step, or spans that miss tokens, are errors, never a guess."""
    first, second = version_label(3, {"a": 1}), version_label(4, {"a": 2, "b": 9})
    c = SimpleNamespace(
        token_ids=[1, 2, 3, 4, 5], weight_versions=[_span(first, 0, 2), _span(second, 2, 5)]
    )
    assert token_steps(c, 3, labelled=True) == [3, 3, 4, 4, 4]
    assert token_steps(c, 1, True, adapter="a") == [1, 1, 2, 2, 2]
    assert token_steps(c, 7, labelled=False) == [7] * 5
    assert token_steps(SimpleNamespace(token_ids=[1, 2], weight_versions=None), 3, True) == [3, 3]
    for bad in ("default", version_label(None, {})):
        with pytest.raises(RuntimeError, match="labelled tokens with weight version"):
            token_steps(SimpleNamespace(token_ids=[1], weight_versions=[_span(bad, 0, 1)]), 3, True)
    with pytest.raises(RuntimeError, match="labelled tokens with weight version"):
        token_steps(c, 9, True, adapter="b")  # b had no newest slot at first
    with pytest.raises(RuntimeError, match="cover 2 tokens of 3"):
        token_steps(
            SimpleNamespace(token_ids=[1, 2, 3], weight_versions=[_span(first, 0, 2)]), 3, True
        )
