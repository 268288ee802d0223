"""One rank's side of checkpoints: writing its shard (now or in the background), a load in
two phases (stage, then apply), and a survivor's state for a restore from live peers
(``workers/control/peers.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.api import CheckpointInfo, TrainctlError
from trainctl.workers.engine.boundary import WrittenFile
from trainctl.workers.rank.background_save import BackgroundSave

if TYPE_CHECKING:
    from trainctl.workers.engine.shard import EngineShard


class RankCheckpoints:
    """This rank's checkpoint work over its engine shard. Owns the shard staged by a load
    until it is applied or dropped, and the background write (``saving``)."""

    def __init__(self, shard: EngineShard, rank: int, world_size: int) -> None:
        self.shard = shard
        self.rank = rank
        self.world_size = world_size
        self._staged: tuple[str, Any] | None = None
        """A shard read by ``stage`` or ``stage_peers`` (with the adapter to load from it, and
        as what), waiting for ``apply``."""
        self.saving = BackgroundSave()
        """The write in the background (``start``)."""

    def save(
        self, directory: str, adapter: str | None, reshardable: bool, header: dict[str, Any]
    ) -> WrittenFile:
        """Write this rank's shard of the training state (``adapter``: that adapter's alone)
        into ``directory`` (not yet final: the controller renames the directory once every
        rank has written), hashed as it is written, with ``header`` (the save's id, step and
        layout); ``reshardable``: in the format any layout loads
        (``workers/engine/checkpoint/reshard.py``)."""
        from trainctl.workers.engine.checkpoint import files

        ckpt = self.shard.checkpoint
        state = ckpt.reshardable_state(adapter) if reshardable else ckpt.state(adapter)
        return files.write(state, Path(directory), self.rank, header)

    def start(
        self, directory: str, adapter: str | None, reshardable: bool, header: dict[str, Any]
    ) -> float:
        """``save`` in the background (``--async-save``): copy this rank's state and base
        weights now (the seconds it took: all the step waits for), then write and hash the
        state, and hash the weights (the manifest's digest), in a thread; ``written`` says
        when it is done."""
        from trainctl.workers.engine.checkpoint import files

        t0 = time.perf_counter()
        ckpt = self.shard.checkpoint
        if reshardable:  # pieces are fp32 host copies already
            state = ckpt.reshardable_state(adapter)
        else:  # the live tensors: copied, since training goes on while they are written
            state = files.snapshot(ckpt.state(adapter))
        base = None if adapter is not None else files.snapshot(self.shard.base_parameters())
        self.saving.start(state, Path(directory), self.rank, header, base)
        return time.perf_counter() - t0

    def written(self) -> WrittenFile | None:
        """The file of the background write once done, None while it runs; its error if it
        failed."""
        return self.saving.written()

    def stage(
        self,
        directory: str,
        info: CheckpointInfo,
        adapter: str | None,
        into: str | None,
        optimizer: bool,
    ) -> None:
        """Phase 1 of a load, changing nothing: prove this rank's share of the checkpoint's
        files against its manifest ``info`` (every file is proved by one rank, whatever the
        writer's layout), then read this rank's shard and check it fits (``adapter``: that
        adapter's part, loaded as ``into``). Only tensors and plain containers are unpickled
        (``weights_only``). A reshardable checkpoint: this rank's shard is cut out of every
        rank file, written at any layout. A problem is a ``CheckpointInvalidError`` (409)
        naming the file and why."""
        from trainctl.workers.engine.checkpoint import files

        path, cid = Path(directory), info.checkpoint_id
        files.prove(
            path, info, files.share(path, info, self.rank, self.world_size), optimizer=optimizer
        )
        ckpt = self.shard.checkpoint
        try:
            if info.format == "reshardable":
                staged = ckpt.stage_reshardable(files.reader(path, cid), adapter, into)
                self._staged = ("reshardable", staged)
                return
            state = files.read(path / files.name(self.rank), cid)
            ckpt.check(state, adapter, into)
        except TrainctlError:
            raise
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # it does not fit here
            raise files.invalid(cid, None, str(e)) from None
        self._staged = ("per_rank", (state, adapter, into))

    def apply(self, optimizer: bool) -> int:
        """Phase 2 of a load, once every rank staged its shard: local, no collective; the
        step loaded."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("apply_checkpoint without a staged checkpoint")
        kind, what = staged
        if kind == "reshardable":
            self.shard.checkpoint.apply_reshardable(what, optimizer=optimizer)
        else:
            state, adapter, into = what
            self.shard.checkpoint.load(state, optimizer=optimizer, adapter=adapter, into=into)
        return int(self.shard.step)

    def drop_staged(self) -> None:
        """Forget a staged shard (another rank failed its stage)."""
        self._staged = None

    def peer_state(self) -> tuple[int, dict[str, Any]]:
        """A survivor's whole training state in the reshardable format, every piece written as
        if this rank were DP replica 0 (it stands in for the replicas that died); no
        collective. Called with two returns: the step is read, the state stays in the object
        store for the new ranks."""
        return int(self.shard.step), self.shard.checkpoint.reshardable_state(as_replica0=True)

    def stage_peers(self, states: list[dict[str, Any]]) -> None:
        """Phase 1 of a restore from live peers: this rank's shard cut out of the survivors'
        states (``peer_state``), changing nothing; ``apply`` applies it."""
        from trainctl.workers.engine.checkpoint import reshard

        reader = reshard.Reader.of(states, "peers")
        self._staged = ("reshardable", self.shard.checkpoint.stage_reshardable(reader))
