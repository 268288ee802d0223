"""The plan of a streamed weight sync: which rank sends which pieces of which Hugging Face
tensors, in which buckets. Plain data (no torch): the controller makes it, every sender and
every receiver walks it.

A sync does not gather the model anywhere. Every rank that owns parameters (an *owner*:
DP x CP replica 0 of the dense ones, expert-data-parallel replica 0 of the experts) converts
its own shards to pieces of Hugging Face tensors (``workers/engine/hf_stream.py``) and says
which (``Piece``: a name, where it sits along one dimension of the full tensor, its shape and
dtype). The controller puts each owner's pieces in buckets of at most ``bucket_bytes`` and
checks that the pieces of every tensor tile it exactly, each element once
(``StreamPlan.of``). Each owner then sends its buckets, and a receiver assembles the
tensors (``workers/sampler/buckets.py``): nothing holds more than its own shards and the
bucket it is converting, but the receiver, which holds what it loads.

A bucket travels as a few *messages*: one packed buffer of its small or converted pieces,
and each ``direct`` piece (a large contiguous view of a parameter) by itself, so the sender
copies only what conversion had to make anyway, and the receiver reads a piece that is a
block of rows straight into its place.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

Schema = dict[str, tuple[tuple[int, ...], str]]
"""A weight set's names, each with its shape and dtype."""

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "uint8": 1}


def itemsize(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"not a weight dtype: {dtype!r}")
    return ITEMSIZE[name]


@dataclass(frozen=True)
class Piece:
    """Part of one Hugging Face tensor, as one owner sends it."""

    name: str
    dim: int
    """The dimension along which it is a block of the full tensor (0: rows, 1: columns)."""
    start: int
    """Its offset along ``dim``."""
    shape: tuple[int, ...]
    dtype: str
    full: tuple[int, ...]
    """The full tensor's shape."""
    direct: bool = False
    """It travels as a message of its own (a contiguous view of a parameter: no copy)."""

    @property
    def nbytes(self) -> int:
        return itemsize(self.dtype) * math.prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.shape == self.full

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.name, self.dim, self.start)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Piece:
        return Piece(**d | {"shape": tuple(d["shape"]), "full": tuple(d["full"])})


@dataclass(frozen=True)
class Bucket:
    """What one owner sends at once: a packed message of its small pieces, then each direct
    piece as its own message (``messages``)."""

    owner: int
    """The trainer rank that sends it."""
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def messages(self) -> list[tuple[Piece, ...]]:
        """The bucket's messages in send order: the packed pieces (if any), then each direct
        one alone."""
        packed = tuple(p for p in self.pieces if not p.direct)
        return ([packed] if packed else []) + [(p,) for p in self.pieces if p.direct]


def alone(message: tuple[Piece, ...]) -> Piece | None:
    """The direct piece a message is (None: a packed message)."""
    return message[0] if len(message) == 1 and message[0].direct else None


@dataclass(frozen=True)
class StreamPlan:
    """One sync's buckets, every owner's, in the order a receiver takes them (owners
    interleaved: they send at once)."""

    owners: tuple[int, ...]
    """The trainer ranks that send, in the order of their ranks in a collective's group."""
    buckets: tuple[Bucket, ...]

    @staticmethod
    def of(pieces: dict[int, list[Piece]], bucket_bytes: int) -> StreamPlan:
        """Each owner's pieces (by trainer rank, in its own order) in buckets of at most
        ``bucket_bytes`` (a piece larger than that alone in one), checked to tile every
        tensor once (``check``)."""
        per_owner = {
            rank: _buckets(rank, ps, bucket_bytes) for rank, ps in sorted(pieces.items()) if ps
        }
        order: list[Bucket] = []
        for i in range(max((len(b) for b in per_owner.values()), default=0)):
            order += [b[i] for b in per_owner.values() if i < len(b)]
        out = StreamPlan(tuple(per_owner), tuple(order))
        out.check()
        return out

    @property
    def schema(self) -> Schema:
        """The Hugging Face tensors the plan builds, each with its full shape and dtype (as
        ``transport.schema_of`` names it)."""
        return {
            p.name: (p.full, "torch." + p.dtype.removeprefix("torch."))
            for b in self.buckets
            for p in b.pieces
        }

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def of_owner(self, rank: int) -> list[tuple[int, Bucket]]:
        """``rank``'s buckets with their index in the plan (the tag of their messages)."""
        return [(i, b) for i, b in enumerate(self.buckets) if b.owner == rank]

    @cached_property
    def _first_tags(self) -> list[int]:
        """Each bucket's first message tag: the messages of the buckets before it."""
        return list(itertools.accumulate((len(b.messages()) for b in self.buckets), initial=0))

    def tags(self, index: int) -> list[int]:
        """The message tags of bucket ``index``: unique in the plan."""
        return list(range(self._first_tags[index], self._first_tags[index + 1]))

    def completion(self) -> list[list[str]]:
        """For each bucket, the tensors its arrival completes (their last piece is in it), in
        the order of those pieces: the order a receiver that takes the buckets one by one can
        hand tensors on whole (``relay.py``), which vLLM's ``nccl`` engine must be told in
        advance."""
        left: dict[str, int] = {}
        for b in self.buckets:
            for p in b.pieces:
                left[p.name] = left.get(p.name, 0) + 1
        out: list[list[str]] = []
        for b in self.buckets:
            done = []
            for p in b.pieces:
                left[p.name] -= 1
                if not left[p.name]:
                    done.append(p.name)
            out.append(done)
        return out

    def check(self) -> None:
        """A ValueError unless every tensor's pieces tile it exactly: one dtype, one full
        shape, blocks along one dimension that cover it with no gap and no overlap."""
        by_name: dict[str, list[Piece]] = {}
        for b in self.buckets:
            for p in b.pieces:
                by_name.setdefault(p.name, []).append(p)
        for name, ps in by_name.items():
            full, dtype = ps[0].full, ps[0].dtype
            if any(p.full != full or p.dtype != dtype for p in ps):
                raise ValueError(f"{name}: its pieces disagree on the full shape or dtype")
            covered = sum(math.prod(p.shape) for p in ps)
            if covered != math.prod(full):
                raise ValueError(f"{name}: its pieces hold {covered} elements of {math.prod(full)}")
            for dim in {p.dim for p in ps}:
                spans = sorted((p.start, p.start + p.shape[dim]) for p in ps if p.dim == dim)
                if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
                    raise ValueError(f"{name}: two pieces overlap along dimension {dim}")
            for p in ps:
                rest = [s for d, s in enumerate(p.shape) if d != p.dim]
                if rest != [s for d, s in enumerate(full) if d != p.dim] or (
                    p.start + p.shape[p.dim] > full[p.dim]
                ):
                    raise ValueError(f"{name}: a piece of shape {p.shape} at {p.start} "
                                     f"along dimension {p.dim} is outside {full}")  # fmt: skip
            if len({p.dim for p in ps}) > 1:
                raise ValueError(f"{name}: pieces along more than one dimension")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (lists): it travels through vLLM's ``collective_rpc``."""
        return {
            "owners": list(self.owners),
            "buckets": [
                {"owner": b.owner, "pieces": [asdict(p) for p in b.pieces]} for b in self.buckets
            ],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StreamPlan:
        return StreamPlan(
            tuple(d["owners"]),
            tuple(
                Bucket(b["owner"], tuple(Piece.from_dict(p) for p in b["pieces"]))
                for b in d["buckets"]
            ),
        )

    @staticmethod
    def whole(schema: Schema, bucket_bytes: int, owner: int = 0) -> StreamPlan:
        """The plan of one owner that holds every tensor whole (a test's sender, one engine
        fed by hand): large tensors direct."""
        pieces = [
            Piece(
                n,
                0,
                0,
                shape,
                dtype.removeprefix("torch."),
                shape,
                direct=itemsize(dtype) * math.prod(shape) >= DIRECT,
            )
            for n, (shape, dtype) in sorted(schema.items())
        ]
        return StreamPlan.of({owner: pieces}, bucket_bytes)


@dataclass(frozen=True)
class Sent:
    """What one owner reports of its part of a sync."""

    nbytes: int
    """Bytes of its buckets (each receiver got them once)."""
    convert_s: float
    """Seconds converting its shards into buckets."""
    transfer_s: float
    """Seconds putting them in the object store or sending them, the conversion included
    where the two overlap (the collective)."""
    peak_bytes: int | None
    """Host memory it added at its peak during the sync: its resident set's high-water mark
    less its size when the sync began, shared-memory pages it wrote into the object store
    included (None: not measurable here)."""
    private_bytes: int | None
    """The same of its private memory alone (sampled): what converting took."""


DIRECT = 1 << 20
"""Bytes from which a contiguous piece travels as a message of its own: below, packing it
costs less than a message."""


def _buckets(owner: int, pieces: list[Piece], bucket_bytes: int) -> list[Bucket]:
    out: list[list[Piece]] = [[]]
    filled = 0
    for p in pieces:
        if filled + p.nbytes > bucket_bytes and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(p)
        filled += p.nbytes
    return [Bucket(owner, tuple(b)) for b in out if b]
