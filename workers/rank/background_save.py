"""A rank's checkpoint write in the background (``--async-save``): the state is copied while
the step waits (the only stall), then written, hashed and renamed by a thread of this rank
while training goes on. The controller asks ``written`` until every rank's file is done and
only then commits the checkpoint (manifest, fsync, rename), so an unfinished write is never
listed (``workers/control/saves.py``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from trainctl.workers.engine.boundary import WrittenFile


class BackgroundSave:
    """Owns this rank's one checkpoint write in flight: its thread and, once it ends, what it
    wrote or why it failed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._written: WrittenFile | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self,
        state: dict[str, Any],
        directory: Path,
        rank: int,
        header: dict[str, Any],
        base: list[tuple[str, Any]] | None = None,
    ) -> None:
        """Write ``state`` (a copy this object now owns: training may change the live one)
        into ``directory`` in a thread; then hash ``base`` (a copy of the base's parameters,
        in ``weights_digest``'s order) into the file's ``weights_digest``. One at a time: a
        second while one runs is an error."""
        import dataclasses

        from trainctl.workers.engine import weights
        from trainctl.workers.engine.checkpoint import files

        if self.busy:
            raise RuntimeError("a checkpoint write is already in flight on this rank")
        self._written, self._error = None, None

        def run() -> None:
            try:
                written = files.write(state, directory, rank, header)
                if base is not None:
                    written = dataclasses.replace(written, weights_digest=weights.digest(base))
                self._written = written
            except BaseException as e:  # reported by written(), never lost
                self._error = e

        self._thread = threading.Thread(target=run, name=f"checkpoint-write-{rank}", daemon=True)
        self._thread.start()

    def written(self) -> WrittenFile | None:
        """The last write's file once written, None while it runs; the write's own error if
        it failed; a ``RuntimeError`` if no write was started on this rank (a rank built
        since: the write died with the rank that started it)."""
        if self._thread is None:
            raise RuntimeError("no checkpoint write was started on this rank")
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._written

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the write in flight (if any) ends."""
        if self._thread is not None:
            self._thread.join(timeout_s)
