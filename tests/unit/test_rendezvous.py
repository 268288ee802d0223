"""The rendezvous store behind the group's secret (workers/rendezvous.py): a member through
its door sets and reads keys; a store client or a raw socket without the secret reaches
nothing, and the store holds no key of theirs."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from trainctl.workers import rendezvous

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def gated() -> Iterator[tuple[object, rendezvous.Gate]]:
    """A master store on loopback and its gate on a free port (with a short admission)."""
    store = rendezvous.master_store(3, timeout_s=10)
    listener = socket.create_server(("127.0.0.1", 0))
    gate = rendezvous.Gate(listener, SECRET, admit_s=1.0)
    gate.open(store.port)
    yield store, gate
    gate.close()


def test_a_member_through_its_door_sets_and_reads(gated: tuple[object, rendezvous.Gate]) -> None:
    store, gate = gated
    member, door = rendezvous.member_store("127.0.0.1", gate.port, SECRET, 3, timeout_s=10)
    try:
        member.set("from-member", b"1")
        store.set("from-master", b"2")  # type: ignore[attr-defined]
        assert store.get("from-member") == b"1"  # type: ignore[attr-defined]
        assert member.get("from-master") == b"2"
        assert gate.refused == 0
    finally:
        door.close()


def test_without_the_secret_nothing_reaches_the_store(
    gated: tuple[object, rendezvous.Gate],
) -> None:
    store, gate = gated
    before = store.num_keys()  # type: ignore[attr-defined]
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own error kinds
        outsider = TCPStore("127.0.0.1", gate.port, 3, is_master=False,
                            timeout=timedelta(seconds=4))  # fmt: skip
        outsider.set("planted", b"x")
    door = rendezvous.Door("127.0.0.1", gate.port, "f" * 32)  # a wrong secret
    with pytest.raises(Exception):  # noqa: B017
        TCPStore("127.0.0.1", door.port, 3, is_master=False,
                 timeout=timedelta(seconds=4)).set("planted-too", b"x")  # fmt: skip
    door.close()
    with socket.create_connection(("127.0.0.1", gate.port)) as raw:
        raw.sendall(b"\x00" * 64)  # garbage where the secret goes: closed at once
        raw.settimeout(5)
        try:
            answer = raw.recv(16)
        except ConnectionResetError:  # closed with our extra bytes unread
            answer = b""
        assert answer == b""
    deadline = time.monotonic() + 5
    while gate.refused < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gate.refused >= 3
    assert store.num_keys() == before  # type: ignore[attr-defined]
    assert not store.check(["planted"]) and not store.check(["planted-too"])  # type: ignore[attr-defined]
