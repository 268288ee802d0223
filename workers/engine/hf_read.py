"""A Hugging Face checkpoint read a rank's shard at a time: no rank holds the whole model.

A rank asks for each of its parameters by canonical name (``weights.assign``); the reader
reads just the bytes of that rank's shard from the ``*.safetensors`` files (memory-mapped,
opened once): the Hugging Face parts a canonical tensor fuses (``hf.rows``), and of those only
the rows (or, for a row-parallel linear, the columns) the rank's TP shard holds. Which rows
those are is ``hf_stream.row_runs``, the same mapping a weight sync uses the other way. A
pipeline stage asks only for its own layers and an expert rank only for its own experts, so
with every layout the ranks together read the checkpoint about once, and each holds at most
one tensor beyond its shard while it reads.

Before anything is read, the tensor names are checked against the family (``hf.check_names``)
and each tensor's shape against the model's when it is read, each error naming the tensor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine import hf, weights
from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig
from trainctl.workers.engine.families import Fuse
from trainctl.workers.engine.hf_stream import row_runs
from trainctl.workers.engine.weights import shard_rule

log = logging.getLogger(__name__)


class CheckpointReader:
    """The ``*.safetensors`` files of one checkpoint directory, each opened once.

    Owns the open files (closed at the end of its ``with`` block), which file holds each
    tensor, and the count of elements read."""

    def __init__(self, directory: Path, m: ModelConfig) -> None:
        from safetensors import safe_open

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{directory}: no *.safetensors files")
        self.m = m
        self._files = ExitStack()
        self._where: dict[str, Any] = {}
        for f in files:
            handle = self._files.enter_context(safe_open(str(f), framework="pt"))
            self._where |= dict.fromkeys(handle.keys(), handle)
        hf.check_names(set(self._where), m)
        self._rows = {ours: (theirs, fuse) for ours, theirs, fuse in hf.rows(m)}
        self.elements_read = 0
        """How many tensor elements were read so far: the import's cost, for its log line."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._files.close()

    def elements(self) -> int:
        """Every tensor element of the checkpoint, as if read whole."""
        return sum(self._shape(n).numel() for n in self._where)

    def whole_shape(self, ours: str) -> torch.Size:
        """The full shape of the canonical tensor ``ours``, from the files' headers."""
        theirs, fuse = self._part_names(ours)
        parts = [torch.empty(self._shape(t), device="meta") for t in theirs]
        return hf.join(parts, fuse, self.m).shape

    def whole(self, ours: str) -> Tensor:
        """The full canonical tensor ``ours`` (float32)."""
        theirs, fuse = self._part_names(ours)
        return hf.join([self._read(t) for t in theirs], fuse, self.m)

    def shard(self, ours: str, shape: tuple[int, ...], tp_rank: int, tp: int) -> Tensor:
        """TP rank ``tp_rank``'s shard (of ``tp``) of the canonical tensor ``ours``, whose full
        shape is ``shape`` (float32), reading only the shard's bytes."""
        theirs, fuse = self._part_names(ours)
        meta = torch.empty(shape, device="meta")
        for name, want in zip(theirs, hf.split(meta, fuse, self.m), strict=True):
            got = tuple(self._shape(name))
            if got != tuple(want.shape):
                raise ConfigError(
                    f"{name}: the checkpoint has shape {got}, the model needs {tuple(want.shape)}"
                )
        rule = shard_rule(ours)
        if rule.kind == "replicated" or tp == 1:
            return hf.join([self._read(t) for t in theirs], fuse, self.m)
        local = tuple(rule.shard(meta, tp_rank, tp).shape)
        if rule.kind == "dim" and rule.dim == 1:
            _unfused(ours, fuse)
            width = local[1]
            return self._read(theirs[0], cols=(tp_rank * width, (tp_rank + 1) * width))
        out = torch.empty(local)
        filled = 0
        for run in row_runs(local, theirs, fuse, self.m, rule, tp_rank, tp):
            length = int(run.local.numel())
            out[run.local] = self._read(run.name, rows=(run.start, run.start + length))
            filled += length
        if filled != local[0]:
            raise AssertionError(f"{ours}: {filled} of the shard's {local[0]} rows were read")
        return out

    def _part_names(self, ours: str) -> tuple[tuple[str, ...], Fuse]:
        if ours not in self._rows:
            raise KeyError(f"{ours}: not in a {self.m.family} checkpoint")
        return self._rows[ours]

    def _shape(self, name: str) -> torch.Size:
        return torch.Size(self._where[name].get_slice(name).get_shape())

    def _read(
        self, name: str, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> Tensor:
        part = self._where[name].get_slice(name)
        t: Tensor
        if rows is not None:
            t = part[rows[0] : rows[1]]
        elif cols is not None:
            t = part[:, cols[0] : cols[1]]
        else:
            t = part[:]
        self.elements_read += t.numel()
        return t.float()


def _unfused(ours: str, fuse: Fuse) -> None:
    if fuse:
        raise ValueError(f"{ours}: a column-split tensor that {fuse!r} fuses")


def load(directory: Path, m: ModelConfig) -> dict[str, Tensor]:
    """Every full canonical tensor of a checkpoint (float32): the whole model, for tools and
    tests; an engine reads its shard with ``CheckpointReader.shard``."""
    with CheckpointReader(directory, m) as reader:
        return {ours: reader.whole(ours) for ours, _, _ in hf.rows(m)}


@contextlib.contextmanager
def starting_weights(cfg: EngineConfig, rank: int) -> Iterator[weights.ShardOf]:
    """Where rank ``rank``'s starting weights come from: its shards of the checkpoint
    ``init_hf`` names (only their bytes read, the files open while in the block), else of
    the seeded initialisation."""
    if not cfg.init_hf:
        yield weights.of_full(weights.seeded(cfg.model))
        return
    with CheckpointReader(Path(cfg.init_hf), cfg.model) as reader:
        yield reader.shard
        log.info(
            "rank %d: starting weights from %s (read %.3g G of the checkpoint's %.3g G elements)",
            rank, cfg.init_hf, reader.elements_read / 1e9, reader.elements() / 1e9,
        )  # fmt: skip
