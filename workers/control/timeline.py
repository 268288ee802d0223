"""The controller's side of the timeline: its own spans, every rank's and every sampler
engine's, on its clock.

Each process keeps its spans in its own ring (``workers/spans.py``). A read asks each rank
and engine for its clock, takes its offset from the round trip, and gathers its spans in the
range, shifted onto the controller's clock, with the count its ring dropped. A rank busy with
a step for longer than ``CLOCK_TIMEOUT_S`` (a rank answers one call at a time), or an engine
that does not answer, is left out of this read, and named in the log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from trainctl.workers import spans
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

CLOCK_TIMEOUT_S = 5.0

Found = spans.Found


class Timeline:
    """Reads of the spans of the controller, its ranks and its sampler engines. Owns nothing
    but its references to the rank group and to the function naming the engines."""

    def __init__(
        self, group: RankGroup, engines: Callable[[float, float], Awaitable[Found]] | None = None
    ) -> None:
        self.group = group
        self.engines = engines
        """The sampler engines' read (``SamplerPool.recent_spans``), if there are engines."""

    async def spans(self, since: float, until: float) -> Found:
        """The spans overlapping ``[since, until]`` (the controller's clock), and the spans
        the rings of the processes read dropped so far."""
        reads: list[Awaitable[Found]] = [self._ranks(since, until)]
        if self.engines is not None:
            reads.append(self.engines(since, until))
        parts = await asyncio.gather(*reads)
        out, dropped = spans.between(since, until), spans.dropped()
        for found, lost in parts:
            out += found
            dropped += lost
        return out, dropped

    async def _ranks(self, since: float, until: float) -> Found:
        if not self.group.ranks:
            return [], 0
        sent = spans.now()
        clocks = await self.group.answers(RankWorker.clock, timeout_s=CLOCK_TIMEOUT_S)
        received = spans.now()
        missing = sorted(set(range(len(self.group.ranks))) - set(clocks))
        if missing:
            log.info("timeline: rank(s) %s busy or gone: their spans are left out", missing)
        offsets = {r: spans.clock_offset(now, sent, received) for r, now in clocks.items()}
        got = await asyncio.gather(
            *(self.group.call_one(r, RankWorker.recent_spans, since, until, off)
              for r, off in offsets.items()),
            return_exceptions=True,
        )  # fmt: skip
        out: list[spans.SpanRecord] = []
        dropped = 0
        for rank, part in zip(offsets, got, strict=True):
            if isinstance(part, BaseException):
                log.info("timeline: rank %d did not answer: %s", rank, part)
                continue
            out += part[0]
            dropped += part[1]
        return out, dropped
