"""The sampler tier: real services with vLLM sampler engines (``trainctl serve --samplers``).

It needs the sampler extra (``pip install 'trainctl[sampler]'``), which ``scripts/test``
installs; without vLLM every test here fails, saying so, rather than skipping.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import tenancy
from helpers.hf_models import tiny_model, word_tokenizer
from helpers.otlp import Receiver, receiving
from helpers.parity import (
    MAX_QUEUED,
    MAX_QUEUED_TOKENS,
    PACE_WAIT_S,
    SAMPLER_TIMEOUT_S,
    WINDOW,
)
from helpers.servicekit import Service, running_service
from helpers.tiers import until_last_use


@pytest.fixture(scope="session", autouse=True)
def _vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "the sampler tier needs vLLM: pip install 'trainctl[sampler]' (scripts/test does)"
        )


@pytest.fixture(scope="session")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default at pp=2, with two sampler engines synced after every step through
    the object store (each pipeline stage puts the weights it owns), keeping ``WINDOW``
    versions servable. Its untrained weights are saved as the checkpoint ``untrained``, which a
    test may load to start again from the base model (Tinker's ``create_model`` wants one)."""
    data = tmp_path_factory.mktemp("sampled")
    flags = ("--pp", "2", "--dp", "1", "--samplers", "2", "--sampler-versions", str(WINDOW))
    service = running_service(data, *flags)
    with until_last_use("sampled", "sampler", service) as svc:
        with svc.client() as tc:
            tc.save_checkpoint("untrained")
        yield svc


@pytest.fixture(scope="session")
def qwen3_manual(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A tiny Qwen3 (transformers' own) at tp=2, one sampler engine, synced on demand by
    broadcast (``--sampler-transport collective``), keeping ``WINDOW`` versions: the samplers
    get weights gathered from two TP shards and mapped to Qwen3's names. Its directory holds a
    word-level tokenizer (``word_tokenizer``)."""
    root = tmp_path_factory.mktemp("qwen3-sampled")
    tiny_model("qwen3", Path(root / "hf"))
    word_tokenizer(Path(root / "hf"))  # string stops (test_sampler.py)
    flags = ("--init-hf", str(root / "hf"), "--tp", "2", "--dp", "1", "--samplers", "1",
             "--sampler-sync", "manual", "--sampler-versions", str(WINDOW),
             "--sampler-transport", "collective")  # fmt: skip
    with until_last_use("qwen3_manual", "sampler", running_service(root / "data", *flags)) as svc:
        yield svc


@pytest.fixture(scope="session")
def lora_sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default with room for six adapters and one sampler engine, synced after
    every step, keeping ``WINDOW`` versions servable, with a short call deadline and a small
    admission bound: the LoRA sampling tests and the robustness tests share it (one service
    start fewer)."""
    data = tmp_path_factory.mktemp("lora-sampled")
    flags = ("--max-adapters", "6", "--lora-max-rank", "8", "--samplers", "1",
             "--sampler-versions", str(WINDOW),
             "--sampler-timeout-s", str(SAMPLER_TIMEOUT_S),
             "--sampler-max-queued", str(MAX_QUEUED),
             "--sampler-concurrency", "2",  # two at once: the others wait (the order tests)
             "--sampler-max-queued-tokens", str(MAX_QUEUED_TOKENS))  # fmt: skip
    with until_last_use("lora_sampled", "sampler", running_service(data, *flags)) as svc:
        yield svc


@pytest.fixture(scope="session")
def paced_otlp() -> Iterator[Receiver]:
    """The OTLP/HTTP receiver ``paced`` exports its spans to."""
    with receiving() as r:
        yield r


@pytest.fixture(scope="session")
def paced(tmp_path_factory: pytest.TempPathFactory, paced_otlp: Receiver) -> Iterator[Service]:
    """The embedded default with one sampler engine synced on demand and a staleness bound of
    one step (``--max-staleness 1``); a paced sample waits at most ``PACE_WAIT_S``. Every
    process exports its spans to ``paced_otlp`` too."""
    data = tmp_path_factory.mktemp("paced")
    flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "manual",
             "--max-staleness", "1", "--sampler-queue-timeout-s", str(PACE_WAIT_S),
             "--otlp-endpoint", paced_otlp.url)  # fmt: skip
    with until_last_use("paced", "sampler", running_service(data, *flags)) as svc:
        yield svc


@pytest.fixture(scope="session")
def in_flight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default with one sampler engine updated in flight after every step
    (``--sampler-sync in_flight``): a generation that spans a sync goes on with the new
    weights."""
    data = tmp_path_factory.mktemp("in-flight")
    flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "in_flight")
    with until_last_use("in_flight", "sampler", running_service(data, *flags)) as svc:
        yield svc


@pytest.fixture(scope="session")
def tenants_sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """Three tenants (``tenancy.KEYS``) and the operator (``tenancy.OPERATOR``) on one LoRA
    service with one sampler engine, its tables' bounds set small: with four parties each
    holds 16 sessions, 32 sampling clients, 8 parked requests, 4 samples in flight and one
    adapter."""
    root = tmp_path_factory.mktemp("tenants-sampled")
    keys = root / "api-keys"
    keys.write_text(tenancy.keys_text())
    flags = ("--dp", "1", "--max-adapters", "4", "--lora-max-rank", "8", "--samplers", "1",
             f"--api-keys={keys}", "--tinker-max-sessions", "64",
             "--tinker-max-sampling-clients", "128", "--tinker-max-parked", "32",
             "--sampler-max-queued", "16")  # fmt: skip
    service = running_service(root / "data", *flags, env={"TRAINCTL_API_TOKEN": tenancy.OPERATOR})
    with until_last_use("tenants_sampled", "sampler", service) as svc:
        yield svc
