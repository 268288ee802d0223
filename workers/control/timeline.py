"""The controller's side of the timeline: its own spans and every rank's, on its clock.

Each rank keeps its spans in its own ring (``workers/spans.py``). A read asks every rank for
its clock (a rank busy with a step for longer than ``CLOCK_TIMEOUT_S`` is left out of this
read, and named), takes each rank's offset from the round trip, and gathers the spans in the
range, shifted onto the controller's clock."""

from __future__ import annotations

import asyncio
import logging

from trainctl.workers import spans
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.rank.worker import RankWorker

log = logging.getLogger(__name__)

CLOCK_TIMEOUT_S = 5.0


class Timeline:
    """Reads of the spans of the controller and its ranks. Owns nothing but its reference to
    the rank group."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    async def spans(self, since: float, until: float) -> tuple[list[spans.SpanRecord], int]:
        """The spans overlapping ``[since, until]`` (the controller's clock), and the spans the
        controller's ring dropped so far (the ranks' drops are not counted yet)."""
        own = spans.ring()
        out = spans.between(since, until)
        dropped = own.dropped if own is not None else 0
        if not self.group.ranks:
            return out, dropped
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
        for rank, part in zip(offsets, got, strict=True):
            if isinstance(part, BaseException):
                log.info("timeline: rank %d did not answer: %s", rank, part)
                continue
            out += part
        return out, dropped
