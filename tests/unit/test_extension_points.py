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
    from trainctl.workers.control.samplers import check_engines

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
