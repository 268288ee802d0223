"""The ``trainctl`` command line as a user runs it: a real process, real HTTP, against the
gateway app with a fake controller served by uvicorn on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainctl.service.app import create_app
from trainctl.service.cluster import free_port

from helpers.fakes import FakeController
from helpers.loopback import served
from helpers.servicekit import Squatter


@pytest.fixture
def url(fake: FakeController) -> Iterator[str]:
    with served(create_app(fake)) as base:
        yield base


def trainctl(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainctl.clients.cli", *args]
    return subprocess.run(cmd, text=True, timeout=60, **kwargs)  # type: ignore[call-overload,no-any-return]


def test_output_into_a_closed_pipe_ends_quietly(url: str) -> None:
    """`trainctl info | head`: once the reader is gone, exit like a Unix tool, no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader at all: the first write fails, deterministically
    try:
        r = trainctl("--url", url, "info", stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert r.stderr == "", r.stderr
    assert r.returncode == 128 + signal.SIGPIPE


def test_memory_profile_download_says_where_files_go(url: str, tmp_path: Path) -> None:
    httpx.post(f"{url}/v1/memory_profile/start", json={}).raise_for_status()
    httpx.post(f"{url}/v1/memory_profile/stop").raise_for_status()
    r = trainctl(
        "--url", url, "memory-profile", "download", "p1", "-o", str(tmp_path), capture_output=True
    )
    assert r.returncode == 0, r.stderr
    target = tmp_path / "p1"
    assert f"downloading 2 file(s) into {target.resolve()}/" in r.stderr
    names = {"snapshot_rank00_p0d0c0t0.trace.json", "snapshot_rank00_p0d0c0t0.png"}
    assert {p.name for p in target.iterdir()} == names
    assert set(r.stdout.split()) == {str(target / n) for n in names}
    assert (target / "snapshot_rank00_p0d0c0t0.trace.json").read_bytes() == b'{"traceEvents": []}'


def test_serve_settings_errors_are_one_line() -> None:
    r = trainctl("serve", "--dp", "0", capture_output=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "trainctl: invalid settings: --dp: Input should be greater than or equal to 1"
    ]


def test_an_infinite_learning_rate_flag_is_refused() -> None:
    r = trainctl("serve", "--lr", "inf", capture_output=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "trainctl: invalid settings: --lr: Input should be a finite number"
    ]


def test_a_sampler_bound_the_gateway_cannot_reach_is_refused_naming_both_flags() -> None:
    """With samplers, a gateway that holds fewer requests than ``--sampler-max-queued``
    would leave the rest in Serve's proxy, never answered 429: refused at start, in flag
    words. The defaults reach it (1024 held, 256 queued)."""
    from trainctl.service.settings import Settings

    assert Settings(samplers=1).max_ongoing_requests >= Settings(samplers=1).sampler_max_queued
    r = trainctl("serve", "--samplers", "1", "--max-ongoing-requests", "8", capture_output=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "trainctl: invalid settings: max_ongoing_requests 8 is below sampler_max_queued 256: "
        "samples past the gateway's hold would wait in Serve's proxy instead of answering the "
        "samplers' 429; raise --max-ongoing-requests to at least 256 or lower "
        "--sampler-max-queued"
    ]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (("--metrics-log", "tensorboard:/srv/x"),
         "metrics_log: '/srv/x' leaves the data directory; name a directory inside it"),
        (("--metrics-log", "mlflow:../up"),
         "metrics_log: '../up' leaves the data directory; name a directory inside it"),
        (("--sampler-backend", "sglang"),
         "--sampler-backend: no sampler backend 'sglang'; one of vllm"),
    ],
)  # fmt: skip
def test_a_flag_error_exits_2_in_one_line_before_ray_starts(
    tmp_path: Path, flags: tuple[str, ...], line: str
) -> None:
    """What a new user meets first: a bad flag is one line naming it, within seconds, and no
    Ray process is started (a tracker outside the data directory used to start Ray and die
    in the controller's constructor, the reason only in a traceback)."""
    import time

    import psutil

    mark = f"flag-error-{os.getpid()}-{time.monotonic_ns()}"  # inherited by what it starts
    t0 = time.monotonic()
    env = {**os.environ, "TRAINCTL_TEST_MARK": mark}
    r = trainctl("serve", "--data-dir", str(tmp_path), *flags, capture_output=True, env=env)
    took = time.monotonic() - t0
    assert r.returncode == 2 and took < 5, (r.returncode, took, r.stderr)
    assert r.stderr.strip().splitlines() == [f"trainctl: invalid settings: {line}"]
    # Ray's daemons of this start would carry its environment: another Ray on this machine
    # (a parallel test run's) is not this one's.
    started = [
        p.info["name"] for p in psutil.process_iter(["name", "environ"])
        if any(k in (p.info["name"] or "") for k in ("raylet", "gcs_server"))
        and (p.info["environ"] or {}).get("TRAINCTL_TEST_MARK") == mark
    ]  # fmt: skip
    assert not started and not (tmp_path / "ray").exists(), started


def test_shrink_with_per_rank_checkpoints_is_refused_at_start_in_one_line() -> None:
    """A shrunk service restores and saves on fewer replicas: per-rank checkpoints load into
    their own layout only. The default format shrinks."""
    from trainctl.service.settings import Settings

    assert Settings(on_node_loss="shrink").checkpoint_format == "reshardable"
    r = trainctl(
        "serve", "--on-node-loss", "shrink", "--checkpoint-format", "per_rank",
        capture_output=True,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "trainctl: invalid settings: on_node_loss: shrink restarts on fewer DP replicas, and "
        "per_rank checkpoints load into their own layout only; take --checkpoint-format "
        "reshardable or --on-node-loss wait"
    ]


def test_serve_on_a_taken_port_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = trainctl("serve", "--port", str(port), "--data-dir", str(tmp_path), capture_output=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainctl: cannot listen on 127.0.0.1:{port}")
    assert "pass another --port" in lines[0]


def test_a_port_whose_old_connections_wait_in_time_wait_is_reserved_again() -> None:
    """A restart on the same port: the old service's accepted connections, closed on its side
    first, sit in TIME-WAIT for a minute; the reservation binds anyway."""
    import socket

    from trainctl.service.cli import _reserve_port

    with socket.create_server(("127.0.0.1", 0)) as old:
        port = old.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = old.accept()
        accepted.close()  # the server closes first: its end waits in TIME-WAIT
        client.recv(1)
        client.close()
    held = _reserve_port("127.0.0.1", port)
    assert held is not None
    held.close()


def test_serve_against_an_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    r = trainctl(
        "serve", "--ray-address", f"127.0.0.1:{port}", "--data-dir", str(tmp_path),
        capture_output=True,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"trainctl: cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused); "
        "check --ray-address and that the cluster is running"
    ], r.stderr


def test_serve_beyond_loopback_without_a_token_warns(tmp_path: Path) -> None:
    port = free_port()
    args = ("serve", "--host", "0.0.0.0", "--ray-address", f"127.0.0.1:{port}",
            "--data-dir", str(tmp_path))  # fmt: skip
    bare = trainctl(*args, capture_output=True)
    assert (
        bare.returncode == 2
        and "0.0.0.0 serves port 8000 beyond this machine with no API token" in bare.stderr
    ), bare.stderr
    env = {**os.environ, "TRAINCTL_API_TOKEN": "s3cret"}
    tokened = trainctl(*args, capture_output=True, env=env)
    assert tokened.returncode == 2 and "no API token" not in tokened.stderr, tokened.stderr


@pytest.mark.parametrize("name", ["../escaped.json", "/tmp/abs.json", "a/b.json", ".."])
def test_memory_profile_download_refuses_a_server_chosen_path(
    url: str, fake: FakeController, tmp_path: Path, name: str
) -> None:
    fake.file_name = name
    httpx.post(f"{url}/v1/memory_profile/start", json={}).raise_for_status()
    httpx.post(f"{url}/v1/memory_profile/stop").raise_for_status()
    out = tmp_path / "out"
    r = trainctl("--url", url, "memory-profile", "download", "p1", "-o", str(out),
                 capture_output=True)  # fmt: skip
    assert r.returncode != 0 and "refusing the server's file name" in r.stderr, r.stderr
    assert not (tmp_path / "escaped.json").exists() and not Path("/tmp/abs.json").exists()
    assert not out.exists() or not any(out.rglob("*.json"))


def test_ready_is_a_probe_that_a_squatter_cannot_pass(url: str) -> None:
    """``trainctl ready`` exits 0 on trainctl's readiness, 1 on a 200 from anything else (the
    Helm chart's test pod runs it)."""
    ok = trainctl("--url", url, "ready", capture_output=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "ready", ok.stderr
    squatter = Squatter()
    try:
        got = trainctl("--url", f"http://127.0.0.1:{squatter.port}", "ready", capture_output=True)
    finally:
        squatter.close()
    assert got.returncode == 1 and "not ready" in got.stdout, (got.stdout, got.stderr)


def test_every_loss_option_is_a_flag() -> None:
    """The loss flags come from ``LossConfig``: each field reaches the request, and the
    defaults are the model's."""
    from trainctl.api import LossConfig
    from trainctl.clients import cli

    args = cli.parser().parse_args(
        ["train-batch", "b.jsonl", "--loss-kind", "ppo", "--tis-cap", "2.5", "--clip-high", "0.3",
         "--kl-coef", "0.1", "--beta", "0.2", "--clip-low", "0.1", "--normalization", "sum"]
    )  # fmt: skip
    assert cli._loss(args) == LossConfig(
        kind="ppo", tis_cap=2.5, clip_high=0.3, kl_coef=0.1, beta=0.2, clip_low=0.1,
        normalization="sum",
    )  # fmt: skip
    assert cli._loss(cli.parser().parse_args(["eval-batch", "b.jsonl"])) == LossConfig()


def test_the_gateway_port_must_answer_as_this_start(fake: FakeController) -> None:
    """After start-up the port must answer as this instance: another instance (or anything
    else) is a start-up error; this one answers even while it is not ready (a rank lost at
    once must not read as a squatter); a port that does not answer yet is waited for."""
    from trainctl.service import cli
    from trainctl.service.ray_auth import StartupError

    fake.ready = False
    with served(create_app(fake, instance_id="ours")) as url:
        cli._check_own_port(url, "ours")  # not ready, yet ours
        with pytest.raises(StartupError, match="does not answer as this trainctl service"):
            cli._check_own_port(url, "another-start")
    t0 = time.monotonic()
    cli._check_own_port(f"http://127.0.0.1:{free_port()}", "ours", timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 10  # waited, then left it to readiness


def test_serve_with_samplers_but_no_vllm_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before Ray or a rank starts: the one command that installs what is missing."""
    import importlib.util

    from trainctl.service.cli import serve_main
    from trainctl.service.settings import Settings

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert serve_main(Settings(samplers=1, data_dir=tmp_path, port=0)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "trainctl: --samplers 1 (--sampler-backend vllm) needs vLLM, which is not installed: "
        "pip install 'trainctl[sampler]' (from a checkout: scripts/serve --samplers N "
        "installs it)"
    ]
