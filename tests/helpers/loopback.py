"""An ASGI app served by a real uvicorn server on a loopback port, in a thread (fast tier)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from trainctl.service.cluster import free_port


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a loopback port, as a real HTTP server; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
