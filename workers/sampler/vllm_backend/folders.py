"""The folders a sampler engine writes: its model ``config.json`` (in the temporary directory)
and its adapters' files (in memory, ``/dev/shm``, where it exists), and the sweep of those an
engine killed before it could remove them left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def memory_dir() -> str | None:
    """A memory-backed directory for adapter files (None: the default temporary one)."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


CONFIG_DIR_PREFIX = "trainctl-sampler-"
"""An engine's folder for its ``config.json`` (in the temporary directory): prefix, pid, -."""
ADAPTER_DIR_PREFIX = "trainctl-adapters-"
"""An engine's folder for adapter files (in ``memory_dir``): prefix, pid, -."""


def sweep_left_behind() -> None:
    """Remove the folders of engines that no longer run. The pool ends an engine with a kill,
    which no finalizer survives: each recreated engine left its two folders behind, one of
    them in memory (``/dev/shm``). A folder whose pid still runs is left alone."""
    roots = ((tempfile.gettempdir(), CONFIG_DIR_PREFIX),
             (memory_dir() or tempfile.gettempdir(), ADAPTER_DIR_PREFIX))  # fmt: skip
    for root, prefix in roots:
        for folder in Path(root).glob(f"{prefix}*"):
            pid = folder.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(folder, ignore_errors=True)
