"""Rendezvous stores that only a group's members reach.

torch's ``TCPStore`` (where gloo's and NCCL's groups meet) takes ``set``, ``get`` and
``delete`` from anyone who connects, with no credential. So a group's store listens on
loopback alone, and two small relays carry its members' connections:

* the **gate**, in the store's process, listens on the node's cluster address; a connection
  gets through only once it has presented the group's secret (compared in constant time),
  and is then relayed to the store; anything else is closed, having reached nothing;
* a **door**, in each other member's process, listens on loopback; each connection the
  member's store client opens there is carried to the gate, the secret first.

The secret travels to the members over Ray, never over the store's port. Rendezvous traffic
is small (the groups' addresses and counters), so a thread per relayed direction is enough.
Imports nothing from trainctl; torch only inside the two store constructors.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

ADMIT_S = 5.0
"""How long a connection to the gate has to present the secret (a door sends it at once)."""
LOOPBACK = "127.0.0.1"


def _token(secret: str) -> bytes:
    """What a door sends first: a fixed-length digest of the group's secret."""
    return hashlib.sha256(b"trainctl-rendezvous:" + secret.encode()).digest()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = conn.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def _serve(listener: socket.socket, handle: Callable[[socket.socket], None], name: str) -> None:
    """Accept on ``listener`` in a thread until it is closed, each connection handled in a
    thread of its own."""

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True, name=name).start()


class _Relays:
    """Owns the relayed connections of a gate or a door: two threads per pair of sockets,
    each copying one direction; either side's end ends both."""

    def __init__(self) -> None:
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()

    def onward(
        self, conn: socket.socket, to: tuple[str, int], timeout_s: float, first: bytes = b""
    ) -> None:
        """Relay ``conn`` to a new connection to ``to``, sending ``first`` there before
        anything of ``conn``'s; ``conn`` is closed if ``to`` cannot be reached."""
        try:
            out = socket.create_connection(to, timeout=timeout_s)
            out.sendall(first)
            out.settimeout(None)
        except OSError:
            conn.close()
            return
        self.relay(conn, out)

    def relay(self, a: socket.socket, b: socket.socket) -> None:
        with self.lock:
            self.sockets |= {a, b}
        for src, dst in ((a, b), (b, a)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._end(src, dst)

    def _end(self, *pair: socket.socket) -> None:
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's thread
            s.close()
            with self.lock:
                self.sockets.discard(s)

    def close(self) -> None:
        with self.lock:
            live = list(self.sockets)
        self._end(*live)


class Gate:
    """The store's side. Owns ``listener`` (a socket bound to the node's cluster address),
    the thread accepting on it, and the relays of the connections it admitted to the store on
    loopback (``open`` says at which port, once the store listens; admitted connections wait
    for it)."""

    def __init__(self, listener: socket.socket, secret: str, admit_s: float = ADMIT_S) -> None:
        self.listener, self.token, self.admit_s = listener, _token(secret), admit_s
        self.port = int(listener.getsockname()[1])
        self.refused = 0
        """Connections closed for want of the secret."""
        self._store_port: int | None = None
        self._opened = threading.Event()
        self._relays = _Relays()
        _serve(listener, self._admit, "rendezvous-gate")

    def open(self, store_port: int) -> None:
        """The store listens at ``store_port`` on loopback: admitted connections go there."""
        self._store_port = store_port
        self._opened.set()

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.admit_s)
            shown = _read_exactly(conn, len(self.token))
        except OSError:
            shown = b""
        if not hmac.compare_digest(shown, self.token):
            self.refused += 1
            log.warning("rendezvous store: a connection without the group's secret was closed")
            conn.close()
            return
        if not self._opened.wait(self.admit_s * 30) or self._store_port is None:
            conn.close()
            return
        conn.settimeout(None)
        self._relays.onward(conn, (LOOPBACK, self._store_port), self.admit_s)

    def close(self) -> None:
        self.listener.close()
        self._relays.close()


class Door:
    """A member's side. Owns a listener on loopback, the thread accepting on it, and the
    relays that carry each of its connections to the gate at ``host:port``, the secret
    first."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float = ADMIT_S) -> None:
        self.gate, self.token, self.timeout_s = (host, port), _token(secret), timeout_s
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self.listener.getsockname()[1])
        self._relays = _Relays()
        _serve(self.listener, self._carry, "rendezvous-door")

    def _carry(self, conn: socket.socket) -> None:
        self._relays.onward(conn, self.gate, self.timeout_s, first=self.token)

    def close(self) -> None:
        self.listener.close()
        self._relays.close()


def master_store(world_size: int, timeout_s: float) -> Any:
    """The group's store, on loopback at a port the OS picks (``.port``): a ``Gate`` admits
    the other members to it."""
    from torch.distributed import TCPStore

    return TCPStore(
        LOOPBACK, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def member_store(
    host: str, port: int, secret: str, world_size: int, timeout_s: float
) -> tuple[Any, Door]:
    """A member's client of the store behind the gate at ``host:port``, and the ``Door`` it
    goes through (close it with the store)."""
    from torch.distributed import TCPStore

    door = Door(host, port, secret)
    try:
        store = TCPStore(
            LOOPBACK, door.port, world_size, is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
    except Exception:
        door.close()
        raise
    return store, door
