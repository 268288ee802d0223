"""``trainctl serve`` as a child process, for notebooks, tests and benchmarks
(``service.py``: ``LocalService``). It sits above the SDK and the service, and nothing in
either imports it."""

from trainctl.local.service import LocalService

__all__ = ["LocalService"]
