"""The rank's side of a streamed weight sync: its own parameters as pieces of the Hugging Face
tensors (``workers/engine/hf_stream.py``), named for the plan (``workers/sampler/stream.py``),
then its buckets put in Ray's object store or sent over the collective. Nothing here gathers
another rank's weights: a rank holds its own shards and the bucket it is converting."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.workers.sampler.stream import DIRECT, Piece, Sent, StreamPlan

if TYPE_CHECKING:
    from torch import Tensor

    from trainctl.workers.engine.hf_stream import HfPiece
    from trainctl.workers.engine.shard import EngineShard


class WeightStreamer:
    """Owns this rank's sending end of streamed syncs: the pieces it owns, and (over the
    collective) its member of the weights' group, with the plan staged for the next send."""

    def __init__(self, engine: EngineShard) -> None:
        self.engine = engine
        self.sender: Any = None
        """``collective.Sender`` or ``nccl_sender.NcclSender``, made on the first collective
        sync (``sender_backend``: for which wire)."""
        self.sender_backend = ""

    @property
    def rank(self) -> int:
        return int(self.engine.coords.rank)

    def _owned(self) -> list[HfPiece]:
        from trainctl.workers.engine.hf_stream import owned_pieces
        from trainctl.workers.engine.lora import is_lora

        e = self.engine
        named = ((n, p) for n, p in e.named_canonical(owned=True) if not is_lora(n))
        return list(owned_pieces(named, e.cfg.model, tp_rank=e.coords.tp, tp=e.cfg.layout.tp))

    def pieces(self) -> list[Piece]:
        """What this rank sends of the base's weights (nothing converted yet)."""
        return [as_piece(h) for h in self._owned()]

    def values(self) -> Callable[[Piece], Tensor]:
        """Each planned piece's values, converted when asked."""
        by_key = {as_piece(h).key: h for h in self._owned()}

        def get(p: Piece) -> Tensor:
            return by_key[p.key].tensor()

        return get

    def to_object_store(self, plan: StreamPlan) -> tuple[list[Any], Sent]:
        """This rank's buckets of ``plan``, each packed and put in Ray's object store as its
        messages' bytes, one after the other (one bucket converted at a time): their
        references (this rank owns the objects), and its report."""
        import ray

        from trainctl.workers.sampler.buckets import pack

        with HostPeak() as peak:
            values = self.values()
            refs, convert_s, put_s, nbytes = [], 0.0, 0.0, 0
            for _, bucket in plan.of_owner(self.rank):
                t0 = time.perf_counter()
                messages = pack(bucket, values)
                t1 = time.perf_counter()
                refs.append(ray.put([m.numpy() for m in messages]))
                nbytes += sum(m.numel() for m in messages)
                del messages
                convert_s, put_s = convert_s + t1 - t0, put_s + time.perf_counter() - t1
        return refs, Sent(nbytes, convert_s, put_s, peak.bytes, peak.private)

    def open_collective(
        self, plan: StreamPlan, receivers: int, generation: int, timeout_s: float, host: str,
        rv: dict[str, Any] | None = None, backend: str = "gloo", bucket_bytes: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """Stage this rank's part of ``plan`` for ``send``: rank 0 makes the group's
        rendezvous (its senders, then ``receivers`` engines) and returns it; every other
        owner joins by it (``rv``). ``backend``: the wire (``workers/sampler/wires.py``):
        ``gloo``, every owner sends to the engines; ``nccl``, rank 0 sends what the other
        owners relay to it over the ranks' own group."""
        from trainctl.workers.sampler.wires import WIRES

        senders = WIRES[backend].senders(plan)
        if self.sender is None or self.sender_backend != backend:
            self.sender, self.sender_backend = self._new_sender(backend), backend
        if rv is None:
            world = senders + receivers
            rv = self.sender.rendezvous(host, world, generation, timeout_s, bucket_bytes).to_dict()
        else:
            self.sender.join(rv, plan.owners.index(self.rank))
        engines = list(range(senders, senders + receivers))
        self.sender.stage(plan, self.rank, engines, self.values())
        return rv

    def _new_sender(self, backend: str) -> Any:
        """The sending end of ``backend``'s wire (the last one's closed)."""
        from trainctl.workers.sampler.wires import GlooWire

        if self.sender is not None:
            self.sender.close()
        if backend == GlooWire.name:
            from trainctl.workers.sampler import collective

            return collective.Sender()
        import torch.distributed as dist

        from trainctl.workers.sampler.vllm_backend.nccl_sender import NcclSender

        return NcclSender(dist.group.WORLD, self.rank)

    def send(self, after_bucket: Callable[[int], None] | None = None) -> Sent:
        """Send the staged buckets to the engines (they receive meanwhile): its report."""
        if self.sender is None:
            raise RuntimeError("send before open_collective")
        with HostPeak() as peak:
            t0 = time.perf_counter()
            sent, convert_s = self.sender.send(after_bucket)
            seconds = time.perf_counter() - t0
        return Sent(int(sent), convert_s, seconds, peak.bytes, peak.private)


class HostPeak:
    """``with HostPeak() as p: work()``, then ``p.bytes``: how far this process's resident
    set rose above its size at the start (the kernel's high-water mark, reset on entry
    through ``/proc/self/clear_refs``), and ``p.private``: how far its private (anonymous)
    memory rose, sampled every ``EVERY_S`` on a thread (the high-water mark also counts the
    shared-memory pages it wrote, which an object-store put does: they are the object
    store's). Both None where there is no ``/proc``: not Linux."""

    STATUS, CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")
    EVERY_S = 0.002

    def __enter__(self) -> HostPeak:
        import threading

        self.start: int | None = None
        self.bytes: int | None = None
        self.private: int | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.CLEAR.write_text("5")  # the high-water mark back to the current size
            self.start = self.read("VmRSS")
            anon = self.read("RssAnon")
        except OSError:
            return self
        self._anon_start = self._anon_peak = anon
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self.EVERY_S):
            self._anon_peak = max(self._anon_peak, self.read("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
        if self.start is not None:
            self.bytes = max(0, self.read("VmHWM") - self.start)
            self._anon_peak = max(self._anon_peak, self.read("RssAnon"))
            self.private = self._anon_peak - self._anon_start

    @classmethod
    def read(cls, field: str) -> int:
        for line in cls.STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise OSError(f"{cls.STATUS} has no {field}")


def as_piece(h: HfPiece) -> Piece:
    """The plan's record of an engine-side piece: where it goes, and whether it can travel
    as it is (a contiguous view of at least ``DIRECT`` bytes)."""
    piece = Piece(h.name, h.dim, h.start, h.shape, str(h.dtype).removeprefix("torch."), h.full)
    return replace(piece, direct=h.view and piece.nbytes >= DIRECT)
