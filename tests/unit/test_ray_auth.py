"""How ``trainctl serve`` sets up Ray's token authentication, without starting Ray."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainctl.service import ray_auth
from trainctl.service.ray_auth import StartupError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No Ray auth variables and an empty HOME, as on a fresh machine."""
    for var in (ray_auth.MODE_ENV, ray_auth.TOKEN_ENV, ray_auth.PATH_ENV):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_own_cluster_writes_a_private_random_token(
    tmp_path: Path, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = ray_auth.own_cluster_token(tmp_path / "data")
    path = tmp_path / "data" / "ray" / "auth_token"
    assert source == str(path.resolve())
    assert os.environ[ray_auth.MODE_ENV] == "token"
    assert os.environ[ray_auth.PATH_ENV] == str(path.resolve())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert list(clean_env.iterdir()) == []  # nothing written to HOME
    # A second start (a new process) reuses its own private token; a token others can read
    # is replaced.
    monkeypatch.delenv(ray_auth.PATH_ENV)
    ray_auth.own_cluster_token(tmp_path / "data")
    assert path.read_text() == token
    path.chmod(0o644)
    monkeypatch.delenv(ray_auth.PATH_ENV)
    ray_auth.own_cluster_token(tmp_path / "data")
    assert path.read_text() != token and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_own_cluster_uses_the_users_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ray_auth.TOKEN_ENV, "a" * 64)
    assert ray_auth.own_cluster_token(tmp_path) == "$RAY_AUTH_TOKEN"
    assert not (tmp_path / "ray").exists()
    monkeypatch.delenv(ray_auth.TOKEN_ENV)
    given = tmp_path / "mine"
    given.write_text("b" * 64)
    monkeypatch.setenv(ray_auth.PATH_ENV, str(given))
    assert ray_auth.own_cluster_token(tmp_path) == str(given)
    assert os.environ[ray_auth.PATH_ENV] == str(given)


def test_a_missing_token_file_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_auth.PATH_ENV, str(tmp_path / "nope"))
    with pytest.raises(StartupError) as e:
        ray_auth.own_cluster_token(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"RAY_AUTH_TOKEN_PATH={tmp_path / 'nope'} cannot")


def test_an_unwritable_data_dir_names_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StartupError, match="pass a writable --data-dir"):
        ray_auth.own_cluster_token(blocker / "data")


def test_joining_finds_the_token_in_rays_usual_places(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ray_auth.joining_token() is None
    assert ray_auth.MODE_ENV not in os.environ  # no token: connect as Ray would, without one
    (clean_env / ".ray").mkdir()
    (clean_env / ".ray" / "auth_token").write_text("c" * 64)
    assert ray_auth.joining_token() == "~/.ray/auth_token"
    assert os.environ[ray_auth.MODE_ENV] == "token"


def test_joining_in_token_mode_without_a_token_says_where_to_put_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ray_auth.MODE_ENV, "token")
    with pytest.raises(StartupError, match="set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"):
        ray_auth.joining_token()
