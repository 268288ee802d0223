"""The split step: ``forward_backward`` parts add their gradients up locally, and
``optim_step`` reduces the sum over DP x CP once (docs/algorithms.md §11).

megatron's schedule ends every pass with ``finalize_model_grads``, which all-reduces (or, under
ZeRO-1, reduce-scatters) the gradient buffers over DP x CP and sums the TP-split norm weights'
and the tied embedding's gradients. Run after every part, a second reduce would sum the first
part's already-reduced gradient again (dp x G1 + G2). So while parts accumulate, the engine
defers that step, and ``finish`` runs it once over the sum of the parts, then divides by the
window's normaliser (the union's token or sequence count: docs/algorithms.md §11).

A part that fails - on this rank or any other - must leave the sum as it was before it: the
buffers are copied before every part after the first, and ``rollback`` restores the copy (or
zeroes the buffers for a first part). The copy costs one fp32 gradient per rank while a window
holds more than one part.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads
from torch import Tensor

from trainctl.workers.engine import megatron_cpu


def grad_buffers(chunks: list[Any]) -> list[Tensor]:
    """The fp32 gradient buffers of megatron's DDP chunks (dense and expert)."""
    return [b.grad_data for c in chunks for b in c.buffers + c.expert_parallel_buffers]


class Accumulation:
    """The gradient window of one engine shard: parts summed locally since the last step. Owns the
    window's parts and what an undo restores."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.parts = 0
        self.deferring = False
        """True while a part runs: the engine's finalize hook must not reduce."""
        self._saved: list[Tensor] | None = None
        self._parts_before = 0
        self._undoable = False
        """A part began since the last rollback, step or clear: ``rollback`` undoes it."""

    def begin_part(self) -> None:
        """Before a part's forward/backward: keep what ``rollback`` restores."""
        self._parts_before = self.parts
        self._saved = [g.clone() for g in grad_buffers(self.chunks)] if self.parts else None
        self._undoable = True
        self.deferring = True

    def end_part(self) -> None:
        self.deferring = False
        self.parts = self._parts_before + 1

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo the last part (this rank's or, after another rank failed, a committed one).
        Once: a rank that failed its part has undone it already when the controller asks every
        rank to."""
        self.deferring = False
        if not self._undoable:
            return
        self._undoable = False
        buffers = grad_buffers(self.chunks)
        if self._saved is None:
            for g in buffers:
                g.zero_()
        else:
            for g, saved in zip(buffers, self._saved, strict=True):
                g.copy_(saved)
        self.parts = self._parts_before
        self._saved = None

    @torch.no_grad()
    def finish(self, divisor: float) -> None:
        """The window's one reduction over DP x CP (and the TP / embedding sums), then the
        division by the window's normaliser. A collective: every rank calls it."""
        if not self.parts:
            raise RuntimeError("no forward_backward part has accumulated gradients")
        with megatron_cpu.cuda_to_cpu():
            finalize_model_grads(self.chunks, None)
        if divisor != 1.0:
            for g in grad_buffers(self.chunks):
                g.mul_(1.0 / divisor)
        self.clear()

    def clear(self) -> None:
        """Forget the window (after a step, or when the gradients are dropped)."""
        self.parts = 0
        self._saved = None
        self._undoable = False
        self.deferring = False
