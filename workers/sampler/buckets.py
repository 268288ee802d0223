"""A streamed sync's buckets as bytes: packed by the owner that sends them, assembled into
whole Hugging Face tensors by the engine that receives them (the plan: ``stream.py``).

Both ends deal in flat ``uint8`` messages, so a bucket means the same to every transport: the
collective receives each message straight into its buffer (``Assembler.buffers``: for a
direct piece that is a block of rows, the place in the full tensor itself), the object
store copies it there from shared memory (``Assembler.fill``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from trainctl.workers.sampler.stream import Bucket, Piece, StreamPlan, alone

Values = Callable[[Piece], Tensor]
"""The sender's side of a piece: its values (a view of a parameter, or converted)."""


def as_bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's bytes, flat (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def pack(bucket: Bucket, values: Values) -> list[Tensor]:
    """The bucket's messages (``Bucket.messages``): its packed pieces copied into one
    buffer, each direct piece's own bytes as they are."""
    out = []
    for message in bucket.messages():
        if direct := alone(message):
            t = values(direct)
            if not t.is_contiguous():
                raise ValueError(f"{direct.name}: a direct piece must be contiguous")
            out.append(as_bytes(t))
        else:  # one buffer, each piece copied into its place as it is made
            sizes = [p.nbytes for p in message]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            for p, place in zip(message, torch.split(buffer, sizes), strict=True):
                place.copy_(as_bytes(values(p).contiguous()))
            out.append(buffer)
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class Assembler:
    """Owns the tensors a receiver is building from one plan's buckets, and which buckets it
    has placed. ``tensors`` hands them over only once every bucket was placed."""

    def __init__(self, plan: StreamPlan) -> None:
        self.plan = plan
        self.full: dict[str, Tensor] = {}
        """The tensors begun: each is made when its first piece arrives."""
        self.placed: set[int] = set()

    def _target(self, p: Piece) -> Tensor:
        """Where piece ``p`` goes in its full tensor (a view; contiguous for a row block)."""
        full = self.full.get(p.name)
        if full is None:
            full = self.full[p.name] = torch.empty(p.full, dtype=_dtype(p.dtype))
        return full.narrow(p.dim, p.start, p.shape[p.dim])

    def take(self, names: Sequence[str]) -> list[tuple[str, Tensor]]:
        """Hand complete tensors on (``StreamPlan.completion``), forgetting them here."""
        return [(n, self.full.pop(n)) for n in names]

    @staticmethod
    def _in_place(message: tuple[Piece, ...]) -> Piece | None:
        """The piece a message is received straight into its place (a direct row block)."""
        p = alone(message)
        return p if p is not None and p.dim == 0 else None

    def buffers(self, index: int) -> list[Tensor]:
        """Bucket ``index``'s messages' receive buffers: for a direct row block its place in
        the full tensor, else a buffer that ``placed`` copies from."""
        out = []
        for message in self.plan.buckets[index].messages():
            if p := self._in_place(message):
                out.append(as_bytes(self._target(p)))
            else:
                out.append(torch.empty(sum(q.nbytes for q in message), dtype=torch.uint8))
        return out

    def placed_into(self, index: int, buffers: Sequence[Tensor]) -> None:
        """Bucket ``index`` arrived in ``buffers`` (``buffers(index)``): put what is not in
        place yet where it goes."""
        messages = self.plan.buckets[index].messages()
        for message, buf in zip(messages, buffers, strict=True):
            if self._in_place(message):
                continue  # received in place
            parts = torch.split(buf, [p.nbytes for p in message])
            for p, part in zip(message, parts, strict=True):
                target = self._target(p)
                if target.is_contiguous():  # bytes to bytes: a packed piece may sit unaligned
                    as_bytes(target).copy_(part)
                else:  # a block of columns
                    target.copy_(part.clone().view(_dtype(p.dtype)).view(p.shape))
        self.placed.add(index)

    def fill(self, index: int, messages: Sequence[Tensor]) -> None:
        """Bucket ``index`` from its messages as bytes (fetched, not received in place)."""
        buffers = self.buffers(index)
        if len(messages) != len(buffers):
            raise ValueError(
                f"bucket {index}: {len(messages)} messages, the plan has {len(buffers)}"
            )
        for buf, m in zip(buffers, messages, strict=True):
            if buf.numel() != m.numel():
                raise ValueError(f"bucket {index}: a message of {m.numel()} bytes, the plan "
                                 f"has {buf.numel()}")  # fmt: skip
            buf.copy_(m)
        self.placed_into(index, buffers)

    def tensors(self) -> dict[str, Tensor]:
        """The assembled tensors; a RuntimeError while a bucket is missing."""
        missing = len(self.plan.buckets) - len(self.placed)
        if missing:
            raise RuntimeError(f"{missing} of {len(self.plan.buckets)} buckets never arrived")
        return self.full
