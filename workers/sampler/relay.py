"""A streamed sync's buckets relayed to one owner, which hands the tensors on whole, one at a
time: for a weight-transfer backend with a single sender (vLLM's ``nccl``: the trainer is its
group's rank 0, and the engines are told every tensor's name, shape and dtype in advance).

The relay (the plan's first owner, trainer rank 0) walks the plan's buckets in order: its own
it packs itself, every other owner's it receives over the trainers' group, each message
straight into its buffer (``buckets.Assembler``). After each bucket it yields the tensors that
bucket completes (``StreamPlan.completion``) and forgets them, so it holds the tensors begun
and not yet complete, never the model. Every other owner sends its buckets to the relay, one
converted at a time, and yields nothing. The relayed bytes are host memory on both ends (on
GPUs the trainers' group takes them over gloo, beside its NCCL): a relay from GPU to GPU is
not written yet.

Torch only: the group is a ``torch.distributed`` group passed in (the ranks' own world
group), and nothing here imports vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from trainctl.workers.sampler.buckets import Assembler, Values, pack
from trainctl.workers.sampler.collective import Posted
from trainctl.workers.sampler.stream import StreamPlan


class Relay:
    """One owner's part of a relayed sync over ``group`` (owners are named by their rank in
    it: trainer ranks in the ranks' world group). Owns what it counts: bytes moved and
    seconds converting."""

    def __init__(self, group: Any, plan: StreamPlan, me: int, values: Values) -> None:
        self.group, self.plan, self.me, self.values = group, plan, me, values
        self.relay = plan.owners[0]
        self.nbytes = 0
        """Bytes this owner packed (its own buckets) or received (the relay: all of them)."""
        self.convert_s = 0.0

    def _pack(self, index: int) -> list[Tensor]:
        t0 = time.perf_counter()
        messages = pack(self.plan.buckets[index], self.values)
        self.convert_s += time.perf_counter() - t0
        self.nbytes += sum(m.numel() for m in messages)
        return messages

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """The relay: every tensor of the plan whole, in ``completion`` order. Any other
        owner: its buckets sent to the relay (a generator: they go as it is walked)."""
        if self.me != self.relay:
            for index, _ in self.plan.of_owner(self.me):
                messages = [m.cpu() for m in self._pack(index)]  # the relay's buffers: host
                works = [
                    self.group.send([m], self.relay, tag)
                    for m, tag in zip(messages, self.plan.tags(index), strict=True)
                ]
                for work in works:
                    work.wait()
            return
        assembler = Assembler(self.plan)
        for index, (bucket, done) in enumerate(
            zip(self.plan.buckets, self.plan.completion(), strict=True)
        ):
            if bucket.owner == self.me:
                assembler.fill(index, self._pack(index))
            else:  # the owner's rank in the trainers' group is its trainer rank
                posted = Posted.post(self.group, assembler, index, bucket.owner)
                self.nbytes += posted.land(assembler)
            yield from assembler.take(done)
