"""Two small things the controller's collaborators share: whether the service takes work
(``Serving``), and the version of the weights the ranks hold with its digests
(``WeightsVersion``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.api import NotReadyError
from trainctl.workers.control.rank_group import RankGroup
from trainctl.workers.control.steps import ModelState


@dataclass
class Serving:
    """Owns whether the service takes work: its ranks are built (``ready``), it is not shutting
    down (``draining``), and, when the ranks cannot be rebuilt yet, why (``waiting``)."""

    ready: bool = False
    draining: bool = False
    waiting: str | None = None
    """Why the workers cannot be rebuilt yet (a lost node): the 503's message."""

    def check(self) -> None:
        """A retryable 503 unless the service takes work now."""
        if self.draining:
            raise NotReadyError("the service is shutting down")
        if not self.ready:
            raise NotReadyError(self.waiting or "the workers are still starting; retry shortly")

    @property
    def taking_work(self) -> bool:
        return self.ready and not self.draining


class WeightsVersion:
    """Owns the version of the weights the ranks hold, the step and an epoch that every load
    and rebuild bumps, and every rank's digest of it, read once per version (``info`` is
    polled; hashing is not free)."""

    def __init__(self, group: RankGroup, state: ModelState) -> None:
        self.group, self.state = group, state
        self.epoch = 0
        self._digests: tuple[tuple[int, int], list[str]] | None = None

    def bump(self) -> None:
        """The weights changed by other means than a step (a load, a rebuild)."""
        self.epoch += 1

    async def digests(self) -> list[str]:
        """Every rank's weights digest, in rank order."""
        version = (self.state.step, self.epoch)
        if self._digests is None or self._digests[0] != version:
            self._digests = (version, await self.group.digests())
        return list(self._digests[1])
