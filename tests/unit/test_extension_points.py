"""An extension point is one registry row: a sampler backend added in a scratch package and
named in ``BACKENDS`` is taken by ``--sampler-backend``, asked at start what this machine
lacks, and asked what it cannot run, with no other change; without its row, none of that
takes it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainctl.workers.engine.config import ConfigError, EngineConfig

TOY = '''
"""A toy sampler backend: what docs/sampling.md says a backend is, and nothing more."""

from trainctl.workers.sampler.backend import SamplerNeeds, UnsupportedError


def engine_class():
    raise NotImplementedError("a toy: no engine")


def env(cuda: bool, threads: int, routes: bool = False) -> dict[str, str]:
    return {"TOY_THREADS": str(threads)}


def check(needs: SamplerNeeds) -> None:
    if needs.moe:
        raise UnsupportedError("sampler_backend: toy runs no mixture of experts")


def missing() -> str | None:
    return "needs toyengine, which is not installed: pip install toyengine"
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The toy package on the path, and its one row in the registry."""
    from trainctl.workers.sampler import backend

    (tmp_path / "toy_sampler_backend").mkdir()
    (tmp_path / "toy_sampler_backend" / "__init__.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backend.BACKENDS, "toy", "toy_sampler_backend")
    yield "toy"
    sys.modules.pop("toy_sampler_backend", None)


def _what_the_service_makes_of(name: str) -> tuple[str, str, str]:
    """The settings' verdict on ``--sampler-backend name --samplers 1``, the start's install
    check, and the engines' capability check on an MoE model."""
    from trainctl.service.cli import StartupError, _check_sampler_stack
    from trainctl.service.launch import sampler_settings
    from trainctl.service.settings import Settings
    from trainctl.workers.control.sampler_settings import check_engines

    s = Settings(samplers=1, sampler_backend=name, sampler_num_gpus=0)  # no Ray to ask
    try:
        _check_sampler_stack(s)
        installed = "installed"
    except StartupError as e:
        installed = str(e)
    moe = EngineConfig.from_dict({"model": {"num_experts": 4, "moe_topk": 2}})
    try:
        check_engines(moe, sampler_settings(s))
        runs = "runs"
    except ConfigError as e:
        runs = str(e)
    return s.sampler_backend, installed, runs


def test_a_backend_is_one_registry_row(toy: str) -> None:
    name, installed, runs = _what_the_service_makes_of(toy)
    assert name == "toy"
    assert installed == (
        "--samplers 1 (--sampler-backend toy) needs toyengine, which is not installed: "
        "pip install toyengine"
    )
    assert runs == "sampler_backend: toy runs no mixture of experts"


def test_without_its_row_the_backend_is_refused_naming_the_flag(
    toy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import ValidationError

    from trainctl.workers.sampler import backend

    monkeypatch.delitem(backend.BACKENDS, "toy")
    with pytest.raises(ValidationError, match="no sampler backend 'toy'; one of vllm"):
        _what_the_service_makes_of(toy)


# -- losses: the row of LOSSES is what the API, the engine and Tinker read ---------------------


def test_every_loss_kind_has_its_row_and_its_function() -> None:
    from trainctl.api import LossKind
    from trainctl.api.loss import LOSSES
    from trainctl.workers.ops.loss import LOSS_KINDS, POLICY_LOSSES

    assert set(LOSSES) == set(LossKind)
    assert set(LOSS_KINDS) == {k.value for k in LossKind}
    assert {k.value for k, s in LOSSES.items() if s.policy} == set(POLICY_LOSSES)


def _what_reads_the_row(kind: str) -> dict[str, object]:
    """What the API, the engine's fused head and Tinker make of ``kind`` now."""
    from pydantic import ValidationError

    from trainctl.api import LossConfig, LossKind, TrainBatchRequest
    from trainctl.api.errors import validation_problem
    from trainctl.service.tinker.convert import config_keys
    from trainctl.workers.engine.loss_inputs import needs_sequence_terms

    seq = {
        "tokens": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "advantages": [0.0, 1.0, 1.0, 1.0],
        "old_logprobs": [0.0, -1.0, -1.0, -1.0], "sequence_ratio_mask": [0, 1, 1, 0],
    }  # fmt: skip
    loss = LossConfig(kind=LossKind(kind))
    try:
        TrainBatchRequest(sequences=[seq], loss=loss)
        ratio_mask = "taken"
    except ValidationError as e:
        ratio_mask = validation_problem(e.errors()[0])
    return {
        "ratio_mask": ratio_mask,
        "sequence_terms": needs_sequence_terms(loss),
        "options": loss.options()["sequence_ratio"],
        "tinker_keys": config_keys()[kind][:2],
    }


def test_a_changed_row_changes_what_every_layer_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """ppo made a sequence-ratio loss reading ``beta`` by its row alone: the API takes a
    ``sequence_ratio_mask`` for it, the engine builds its sequence terms and keeps it out of
    the head's forward pass, and Tinker reads its new config key."""
    import dataclasses

    from trainctl.api import LossKind
    from trainctl.api.loss import LOSSES

    before = _what_reads_the_row("ppo")
    assert before == {
        "ratio_mask": "sequences[0].sequence_ratio_mask is read by the gspo loss only, not by ppo",
        "sequence_terms": False, "options": False,
        "tinker_keys": ("clip_low_threshold", "clip_high_threshold"),
    }  # fmt: skip
    row = dataclasses.replace(LOSSES[LossKind.PPO], sequence_ratio=True, knobs=("beta",))
    monkeypatch.setitem(LOSSES, LossKind.PPO, row)
    after = _what_reads_the_row("ppo")
    assert after == {
        "ratio_mask": "taken", "sequence_terms": True, "options": True,
        "tinker_keys": ("beta", "tis_cap"),
    }  # fmt: skip
