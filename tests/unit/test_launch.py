"""One launch path, one precedence: flag > environment > engine config file > default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainctl.service.cli import _settings_from, build_parser
from trainctl.service.launch import engine_config, settings_from_args
from trainctl.service.settings import Settings


def _file(tmp_path: Path, **engine: object) -> Path:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(engine))
    return path


def _values(cfg: dict) -> tuple[int, int, float, int]:
    return (
        cfg["layout"]["dp"],
        cfg["max_tokens_per_microbatch"],
        cfg["optimizer"]["lr"],
        cfg["model"]["seed"],
    )


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DP", "MAX_TOKENS_PER_MICROBATCH", "LR", "SEED", "ENGINE_CONFIG"):
        monkeypatch.delenv(f"TRAINCTL_{name}", raising=False)


def test_precedence_flag_env_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _file(
        tmp_path,
        layout={"dp": 4},
        max_tokens_per_microbatch=2048,
        optimizer={"lr": 0.5},
        model={"seed": 7},
    )
    # Defaults: the service's (dp=2) and the engine's own.
    assert _values(engine_config(Settings()).to_dict()) == (2, 4096, 1e-3, 1234)
    # The file beats the defaults, every one of them.
    assert _values(engine_config(Settings(engine_config=engine)).to_dict()) == (4, 2048, 0.5, 7)
    # The environment beats the file.
    monkeypatch.setenv("TRAINCTL_DP", "1")
    monkeypatch.setenv("TRAINCTL_MAX_TOKENS_PER_MICROBATCH", "1024")
    assert _values(engine_config(Settings(engine_config=engine)).to_dict()) == (1, 1024, 0.5, 7)
    # A flag beats the environment (and the file).
    argv = ["serve", "--engine-config", str(engine), "--max-tokens-per-microbatch", "3072"]
    argv += ["--lr", "0.25"]
    s = _settings_from(build_parser().parse_args(argv))
    assert _values(engine_config(s).to_dict()) == (1, 3072, 0.25, 7)


def test_serve_args_rank_as_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Serve application's args go through the same settings: `engine` as the file."""
    monkeypatch.setenv("TRAINCTL_SEED", "99")
    args = {"engine": {"layout": {"dp": 1}, "model": {"seed": 5}}, "lr": 0.125}
    assert _values(engine_config(settings_from_args(args)).to_dict()) == (1, 4096, 0.125, 99)
    monkeypatch.delenv("TRAINCTL_SEED")
    assert _values(engine_config(settings_from_args(args)).to_dict()) == (1, 4096, 0.125, 5)
    with pytest.raises(ValueError, match="give one engine config"):
        engine_config(Settings(engine={}, engine_config=_file(tmp_path)))


def test_one_set_of_defaults() -> None:
    """`trainctl serve` with no flags and the Serve application with no args agree."""
    flags = _settings_from(build_parser().parse_args(["serve"]))
    assert flags == settings_from_args({})
    assert engine_config(flags).to_dict() == engine_config(settings_from_args({})).to_dict()


def test_recompute_flag_reaches_the_engine() -> None:
    s = _settings_from(build_parser().parse_args(["serve", "--recompute", "full"]))
    assert engine_config(s).to_dict()["recompute"] == "full"
    assert engine_config(Settings()).to_dict()["recompute"] == "none"
    with pytest.raises(ValueError, match="recompute"):
        _settings_from(build_parser().parse_args(["serve", "--recompute", "some"]))


@pytest.mark.parametrize(
    ("flag", "key", "value", "default"),
    [
        ("--precision", "precision", "bf16", "auto"),
        ("--distributed-optimizer", "distributed_optimizer", "off", "auto"),
        ("--sequence-parallel", "sequence_parallel", "off", "auto"),
        ("--packing", "packing", "flat", "auto"),
    ],
)
def test_memory_flags_reach_the_engine(flag: str, key: str, value: str, default: str) -> None:
    s = _settings_from(build_parser().parse_args(["serve", flag, value]))
    assert engine_config(s).to_dict()[key] == value
    assert engine_config(Settings()).to_dict()[key] == default
    with pytest.raises(ValueError, match=key):
        _settings_from(build_parser().parse_args(["serve", flag, "fp8"]))


def test_auto_precision_and_zero_resolve_by_device_and_layout() -> None:
    from trainctl.workers.engine.config import EngineConfig, ParallelLayout

    cfg = EngineConfig()
    assert (cfg.resolved_precision(cuda=True), cfg.resolved_precision(cuda=False)) == (
        "bf16",
        "fp32",
    )
    assert EngineConfig(precision="fp32").resolved_precision(cuda=True) == "fp32"
    assert not cfg.use_distributed_optimizer  # dp1: nothing to shard over
    assert EngineConfig(layout=ParallelLayout(dp=2)).use_distributed_optimizer
    assert EngineConfig(layout=ParallelLayout(cp=2)).use_distributed_optimizer
    assert not EngineConfig(
        layout=ParallelLayout(dp=2), distributed_optimizer="off"
    ).use_distributed_optimizer


@pytest.mark.parametrize("how", ["env", "file"])
def test_an_empty_token_is_a_startup_error_not_no_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """The review's case: an empty token file or TRAINCTL_API_TOKEN="" turned auth off."""
    from trainctl.service.cli import serve_main

    if how == "env":
        monkeypatch.setenv("TRAINCTL_API_TOKEN", "")
        s = Settings(port=0)
    else:
        (tmp_path / "token").write_text("\n")
        s = Settings(port=0, api_token_file=tmp_path / "token")
    assert serve_main(s) == 2  # before any port, Ray or worker is touched
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("is empty" in err or "set but empty" in err), err
    with pytest.raises(ValueError, match="empty"):
        s.token()


def test_every_layout_axis_is_a_setting_and_reaches_the_engine() -> None:
    """The layout's fields are the flags: an axis added to ``ParallelLayout`` without a
    setting (or a setting marked with a place the engine config lacks) fails here."""
    from dataclasses import fields

    from trainctl.service.settings import engine_settings
    from trainctl.workers.engine.config import EngineConfig, ParallelLayout

    places = engine_settings()
    for axis in fields(ParallelLayout):
        assert places.get(axis.name) == f"layout.{axis.name}", axis.name
    engine = EngineConfig().to_dict()
    for name, place in places.items():
        *sections, key = place.split(".")
        target = engine
        for section in sections:
            target = target[section]
        assert key in target, f"setting {name} is marked for {place}, which is no engine key"
    from trainctl.workers.engine.config import ConfigError

    s = _settings_from(build_parser().parse_args(["serve", "--ep", "2", "--dp", "2"]))
    with pytest.raises(ConfigError, match=r"layout\.ep > 1 needs an MoE model"):
        engine_config(s)  # the tiny default is dense: --ep reached the engine's checks
    assert engine_config(Settings()).layout.ep == 1
