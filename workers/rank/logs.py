"""Logging for the controller, the ranks and the gateway: the operation id on every line.

``configure(level, fmt)`` installs one handler whose records carry ``op`` (the operation this
task works for, from ``current_operation``; ``-`` outside one). ``fmt="json"`` writes
one JSON object per line (``ts``, ``level``, ``logger``, ``op``, ``msg``), for log collectors;
``text`` writes the same fields for people.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time

current_operation: contextvars.ContextVar[str] = contextvars.ContextVar("operation", default="-")
"""Id of the operation this task works for (the controller's queue and the rank actor set it);
the log filter puts it on every line."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [op=%(op)s] %(message)s"


class OperationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "op"):
            record.op = current_operation.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "op": getattr(record, "op", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


_installed: list[logging.Handler] = []
"""The handler ``configure`` installed in this process: the one a second call replaces."""


def configure(level: str | None = None, fmt: str | None = None) -> None:
    """Install the handler on the root logger (replacing earlier ones); idempotent."""
    level = level or os.environ.get("TRAINCTL_LOG_LEVEL", "INFO")
    fmt = fmt or os.environ.get("TRAINCTL_LOG_FORMAT", "text")
    handler = logging.StreamHandler()
    handler.addFilter(OperationFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in _installed:
        root.removeHandler(h)
    _installed[:] = [handler]
    root.addHandler(handler)
    root.setLevel(level)
