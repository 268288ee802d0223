"""The review's hostile inputs, each through the gateway's routes: a clear 4xx, bounded memory
and nothing reaching the controller."""

from __future__ import annotations

import contextlib
import json
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from fastapi.testclient import TestClient

from trainctl.api import PayloadTooLargeError, wire
from trainctl.api.batch import SequenceBatch
from trainctl.service.app import create_app

from helpers.fakes import FakeController
from helpers.loopback import served

LIMIT = 1 << 20
TINKER = {"x-api-key": "tml-any"}


@pytest.fixture
def small(fake: FakeController) -> Iterator[TestClient]:
    """A gateway whose body limit is 1 MiB."""
    with TestClient(create_app(fake, max_body_bytes=LIMIT)) as client:
        yield client


def _zlib_frame(inflated: int) -> bytes:
    """A wire frame whose zlib payload inflates to ``inflated`` zero bytes."""
    header = json.dumps({"fields": {}, "arrays": [
        {"name": "lengths", "dtype": "int64", "shape": [1], "offset": 0, "nbytes": 8},
    ]}).encode()  # fmt: skip
    payload = zlib.compress(bytes(inflated), 9)
    return struct.pack("<4sBBHI", b"TCTB", 1, wire.FLAG_ZLIB, 0, len(header)) + header + payload


def _peak_mib(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def _refused_as_a_bomb(post: Callable[[], Any], fake: FakeController, words: str) -> None:
    """``post()`` answers 413 saying ``words``, holding little memory, reaching nothing."""
    replies: list[Any] = []
    peak = _peak_mib(lambda: replies.append(post()))
    r = replies[0]
    assert r.status_code == 413, r.text
    assert words in r.json()["message"], r.json()
    assert peak < 16, f"{peak:.1f} MiB held while refusing the bomb"
    assert fake.calls == []


def test_a_zlib_bomb_is_413_without_inflating_it(small: TestClient, fake: FakeController) -> None:
    body = _zlib_frame(64 << 20)  # 65 KB on the wire, 64 MiB inflated
    assert len(body) < 100_000
    _refused_as_a_bomb(
        lambda: small.post(
            "/v1/train_batch", content=body, headers={"content-type": wire.CONTENT_TYPE}
        ),
        fake,
        "inflates past the limit of 1048576 bytes",
    )


def test_wire_inflate_is_bounded() -> None:
    blob = zlib.compress(bytes(8 << 20), 9)

    def refuse() -> None:
        with pytest.raises(PayloadTooLargeError):
            wire.inflate(blob, LIMIT)

    assert _peak_mib(refuse) < 4
    assert wire.inflate(zlib.compress(b"x" * 100), 100) == b"x" * 100
    with pytest.raises(wire.WireError, match="truncated"):
        wire.inflate(zlib.compress(b"x" * 1000)[:-6], 10_000)


@pytest.mark.parametrize("states_size", [True, False], ids=["size-in-frame", "streamed"])
def test_a_zstd_bomb_is_413_without_inflating_it(
    small: TestClient, fake: FakeController, states_size: bool
) -> None:
    body = zstandard.ZstdCompressor(level=19, write_content_size=states_size).compress(
        bytes(64 << 20)
    )
    assert len(body) < 10_000
    headers = {**TINKER, "content-encoding": "zstd", "content-type": "application/x-protobuf"}
    _refused_as_a_bomb(
        lambda: small.post("/api/v1/forward_backward", content=body, headers=headers),
        fake,
        "inflates past the limit",
    )


def test_a_shape_that_overflows_int64_is_422(http: TestClient, fake: FakeController) -> None:
    header = json.dumps({"fields": {}, "arrays": [
        {"name": "lengths", "dtype": "int64", "shape": [2**32, 2**32], "offset": 0,
         "nbytes": 0},
    ]}).encode()  # fmt: skip
    body = struct.pack("<4sBBHI", b"TCTB", 1, 0, 0, len(header)) + header
    r = http.post("/v1/train_batch", content=body, headers={"content-type": wire.CONTENT_TYPE})
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith("lengths: shape"), r.json()
    assert fake.calls == []


def test_too_many_sequences_or_tokens_are_422_before_the_controller(fake: FakeController) -> None:
    """The review's case: an 825-byte request of tiny sequences froze the controller."""
    app = create_app(fake, max_sequences=1000, max_tokens_per_request=5000)
    many = wire.encode_sequences(
        SequenceBatch(np.full(1001, 2, np.int64), {"tokens": np.ones(2002, np.int64)}), {},
        compress=True,
    )  # fmt: skip
    long = {"sequences": [{"tokens": [1] * 16}] * 400}  # 6400 tokens
    with TestClient(app) as http:
        r = http.post("/v1/train_batch", content=many,
                      headers={"content-type": wire.CONTENT_TYPE})  # fmt: skip
        assert r.status_code == 422, r.text
        assert r.json()["message"] == (
            "sequences: 1001 sequences exceed this service's limit of 1000 per request: "
            "split the batch"
        )
        r = http.post("/v1/logprobs", json=long)
        assert r.status_code == 422 and "6400 tokens exceed" in r.json()["message"], r.text
        ok = http.post("/v1/train_batch", json={"sequences": [{"tokens": [1, 2]}] * 1000})
        assert ok.status_code == 200, ok.text
    assert fake.calls == ["train_batch"]


class _Payload:
    """A pickle that runs code when unpickled: it writes ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.marker), "ran"))  # type: ignore[return-value]


def test_checkpoint_and_profile_files_are_never_unpickled_as_code(tmp_path: Path) -> None:
    import pickle

    import torch

    from trainctl.workers.control.profile_plot import memory_timeline
    from trainctl.workers.rank.checkpoints import RankCheckpoints

    marker = tmp_path / "ran"
    torch.save({"chunks": [_Payload(str(marker))]}, tmp_path / "rank-00000.pt")
    from trainctl.api import CheckpointInfo, CheckpointInvalidError

    # The files are proved and read before the shard is touched: none is needed here.
    checkpoints = RankCheckpoints(shard=Any, rank=0, world_size=1)  # type: ignore[arg-type]
    for fmt in ("per_rank", "reshardable"):  # a checkpoint saved before digests: read as is
        info = CheckpointInfo(
            checkpoint_id="x", step=0, created_at=0.0, layout={}, weights_digest="",
            size_bytes=0, format=fmt,
        )  # fmt: skip
        refused = r"rank-00000\.pt: the file cannot be read \(it holds objects"
        with pytest.raises(CheckpointInvalidError, match=refused):
            checkpoints.stage(str(tmp_path), info, None, None, optimizer=True)
    with pytest.raises(pickle.UnpicklingError):
        memory_timeline("snapshot.pickle", pickle.dumps(_Payload(str(marker))))
    assert not marker.exists()
    snapshot = {"device_traces": [[{"action": "alloc", "size": 8, "time_us": 1}]]}
    _, total = memory_timeline("snapshot.pickle", pickle.dumps(snapshot))
    assert total.tolist() == [8.0]


def _upload_that_stalls(app: Any, *, trickle: bool) -> tuple[str, float]:
    """A train_batch whose body starts and then stops (``trickle``: goes on a byte every
    0.2 s, never idle); the gateway's reply and how long it took, within 8 s."""
    import socket

    with served(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/train_batch HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
                b"\r\ncontent-length: 1000\r\n\r\n{"
            )
            t0 = time.monotonic()
            sock.settimeout(0.2)
            reply = ""
            while time.monotonic() - t0 < 8 and not reply.endswith("}"):
                if trickle:
                    with contextlib.suppress(OSError):
                        sock.sendall(b" ")
                try:  # the head and the body may come apart
                    reply += sock.recv(4096).decode()
                except TimeoutError:
                    continue
            return reply, time.monotonic() - t0


def test_a_trickled_body_is_dropped_after_its_grace_not_its_whole_deadline(
    fake: FakeController,
) -> None:
    """The re-probe's case: uploads that send a byte now and then (never idle long enough for
    the idle deadline) held their slots for the whole 300 s allowance."""
    app = create_app(fake, body_grace_s=1.0)  # the default deadlines: 30 s idle, 300 s in all
    reply, waited = _upload_that_stalls(app, trickle=True)
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "KiB/s" in reply and waited < 4, (waited, reply)
    assert fake.calls == []


def test_a_slow_body_is_dropped_with_408(fake: FakeController) -> None:
    """The review's case: idle authenticated uploads held every gateway slot for ever."""
    reply, waited = _upload_that_stalls(create_app(fake, body_timeout_s=0.5), trickle=False)
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "send the body at once" in reply and waited < 5
    assert fake.calls == []


def test_server_errors_show_no_paths_addresses_pids_or_tracebacks(
    fake: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainctl.api import WorkerError

    secret = (
        "\x1b[36mcannot open /srv/trainctl/data/checkpoints/step-000001/rank-00001.pt on "
        "10.1.2.3:6379 (pid=4242) by actor 8a2f0c7d5e6b4a3c9d1e2f3a01000000, "
        "<torch.Tensor object at 0x7f3368737810>\x1b[0m"
        '\nTraceback (most recent call last):\n  File "/srv/x.py"'
    )

    async def boom() -> None:
        raise RuntimeError(secret)

    async def worker_error(*_: object) -> None:
        raise WorkerError(f"rank 1 failed in accumulate: {secret}",
                          details={"ranks": {"1": secret}, "causes": {"1": secret}})  # fmt: skip

    monkeypatch.setattr(fake, "info", boom)
    monkeypatch.setattr(fake, "run", worker_error)
    with TestClient(create_app(fake), raise_server_exceptions=False) as http:
        replies = [
            http.get("/v1/info"),
            http.post("/v1/train_batch", json={"sequences": [{"tokens": [1, 2, 3]}]}),
        ]
    for r in replies:
        assert r.status_code == 500, r.text
        body = r.json()
        for leak in ("/srv", "10.1.2.3", "4242", "Traceback", "rank-00001.pt", "causes",
                     "8a2f0c7d5e6b", "0x7f33", "\\u001b", "[36m", "[0m"):  # fmt: skip
            assert leak not in r.text, (leak, r.text)
        assert body["details"]["error_id"] and body["message"].startswith(
            ("RuntimeError: cannot open <path>", "rank 1 failed in accumulate: cannot open")
        ), body


def _listening_addresses(port: int) -> list[str]:
    """The local addresses that listen on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


def test_the_rendezvous_store_listens_on_the_node_address_only() -> None:
    """The review's case: rank 0's TCPStore listened on every interface, uncredentialed."""
    import ray

    from trainctl.workers.rank.worker import RankWorker

    worker = RankWorker(rank=0, world_size=1)
    host, port, secret = worker.rendezvous_address(timeout_s=5)
    assert host == ray.util.get_node_ip_address()
    listening = _listening_addresses(port)
    wildcard = {"00000000", "00000000000000000000000000000000"}
    assert listening and not wildcard & set(listening), listening
    worker.init_process_group(host, port, secret, "gloo", 5)  # the store works as before
    import torch.distributed as dist

    dist.destroy_process_group()


def test_someone_who_reaches_the_rendezvous_store_can_set_nothing() -> None:
    """The re-probes' cases: torch's store takes set and delete from anyone who connects, so
    gloo's rendezvous keys (rank addresses, ``0//cpu//0/0``) could be replaced or deleted, and
    anything planted. The store listens on loopback behind a gate that wants the group's
    secret: a stranger at the rank's address reaches nothing, and every key is under the
    secret's prefix besides."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore

    from trainctl.workers.rank.worker import RankWorker

    worker = RankWorker(rank=0, world_size=1)
    host, port, secret = worker.rendezvous_address(timeout_s=5)
    worker.init_process_group(host, port, secret, "gloo", 5)
    try:
        dist.new_group([0])  # megatron's groups: more keys
        store = worker.join._store
        keys = store.num_keys()
        assert keys >= 2  # the group's keys are there ...
        # ... but not under any name a stranger can know
        assert not store.check(["0//cpu//0/0"]) and not store.check(["0//1//cpu//0/0"])
        with pytest.raises(Exception):  # noqa: B017 - torch raises its own error kinds
            stranger = TCPStore(host, port, 1, is_master=False, timeout=timedelta(seconds=3))
            stranger.set("planted", b"x")
        deadline = time.monotonic() + 10
        while worker.join._gate.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.join._gate.refused >= 1
        assert store.num_keys() == keys and not store.check(["planted"])
    finally:
        dist.destroy_process_group()
        worker.shutdown()


def test_a_cpu_memory_profile_stops_recording_at_its_time_cap(tmp_path: Path) -> None:
    """The review's case: the CPU profiler recorded without bound until stopped."""
    import json as _json

    import torch

    from trainctl.workers.engine.boundary import RankCoords
    from trainctl.workers.engine.profiling import MemoryProfiler

    prof = MemoryProfiler(RankCoords(rank=0, dp=0, cp=0, tp=0, pp=0), cpu_max_seconds=0.2)
    prof.start(max_entries=10)
    torch.ones(1000).sum()
    assert not prof.pause_if_expired()  # within the cap: still recording
    time.sleep(0.3)
    assert prof.pause_if_expired()
    for _ in range(50):  # after the cap: nothing more is recorded
        torch.full((4096,), 7.0).cumsum(0)
    path = prof.stop(tmp_path)
    names = {e.get("name") for e in _json.loads(path.read_text())["traceEvents"]}
    assert "aten::ones" in names and "aten::cumsum" not in names
