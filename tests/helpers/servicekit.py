"""A real trainctl service for the tiers that need one (service, sampler): `trainctl serve` in
its own process session, real Ray, real Serve, real HTTP. Teardown sends SIGTERM, as
Kubernetes does, and checks that the service drained and exited cleanly with nothing left
running.

Every service starts as on a fresh machine: a new empty HOME (so no ``~/.ray``) and none of
Ray's ``RAY_AUTH_*`` variables; trainctl must make its own Ray token.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainctl.local import LocalService

START_TIMEOUT_S = 300


Service = LocalService


def digest(value: str | None) -> str:
    """``value``, checked to be a real sha256 digest: two empty or missing digests must never
    compare equal by accident."""
    assert value is not None and re.fullmatch(r"[0-9a-f]{64}", value), repr(value)
    return value


RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def fresh_home(data_dir: Path) -> dict[str, str | None]:
    """The environment of a new user: an empty HOME beside ``data_dir``, no Ray auth vars."""
    home = data_dir.parent / f"{data_dir.name}-home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        **dict.fromkeys(RAY_AUTH_VARS),
    }


SHARED_RING_SPANS = 400
"""The spans each process of the service tier's shared service keeps (``--trace-spans``)."""


@contextlib.contextmanager
def running_service(
    data_dir: Path, *flags: str, env: dict[str, str | None] | None = None
) -> Iterator[Service]:
    """`trainctl serve FLAGS` until the block ends; then SIGTERM and a clean-exit check."""
    env = {**fresh_home(data_dir), **(env or {})}
    svc = LocalService(data_dir, *flags, start_timeout_s=START_TIMEOUT_S, env=env)
    try:
        svc.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield svc
    except BaseException:
        svc.stop()  # a failed test frees its service too: no Ray cluster outlives it
        raise
    rc = svc.stop()
    assert rc == 0, f"trainctl serve exited with {rc}:\n{svc.log()}"
    assert not svc.leftovers, f"processes left after shutdown: {svc.leftovers}"
    assert "drained in-flight work" in svc.log()


def served_routes(app: Any) -> list[tuple[str, str, Any]]:
    """(method, path template, access) of every route ``app`` serves, native and Tinker (an
    included router's routes one by one): the list the route-driven tests walk, so that a new
    route is covered without editing them."""
    from fastapi.routing import APIRoute

    from trainctl.service.auth import access_of

    def flat(routes: list[Any]) -> Iterator[Any]:
        for r in routes:
            if hasattr(r, "effective_route_contexts"):
                yield from r.effective_route_contexts()
            else:
                yield r

    out = []
    for r in flat(app.routes):
        if isinstance(r, APIRoute) or hasattr(r, "original_route"):
            out += [(method, r.path, access_of(r)) for method in sorted(r.methods)]
    return out


class Squatter:
    """An HTTP server that answers 200 with Prometheus text on every path, as Ray's
    autoscaler metrics exporter did on the port a test had picked for the gateway."""

    def __init__(self) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"# HELP autoscaler_worker_create_node_time\n"
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DroppingProxy:
    """A loopback TCP proxy that, the first time a request carries ``trigger``, hands the
    request to the server and then cuts the client's connection instead of relaying the
    answer: the server did the work, the client saw a dropped connection and retries."""

    def __init__(self, target_port: int, trigger: bytes) -> None:
        self.target_port, self.trigger = target_port, trigger
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = 0
        self._armed = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, cut: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                if self._armed and self.trigger in data:
                    self._armed = False
                    cut.set()
                    upstream.sendall(data)
                    time.sleep(2.0)  # the server receives and runs it
                    self.dropped += 1
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    upstream.close()
                    return
                upstream.sendall(data)

    def _down(self, upstream: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 16):
                if cut.is_set():
                    return
                client.sendall(data)

    def close(self) -> None:
        self.listener.close()
