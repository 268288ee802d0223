"""How far behind the trainer the data it trains on may be: the staleness bound.

Every token a sampler produces carries the weights step that produced it
(``Completion.token_steps``; the base's step, or with an adapter the adapter's). Training data
carries it back: per token (``token_steps``, -1 where no sampler produced the token: a prompt)
or per sequence (``policy_step``, the JSON shorthand for every token at one step). A
sequence's *step* is the oldest step among its loss tokens; its *staleness* is the trainer's
step (of the base, or of the adapter the call trains) minus that.

- ``check``: the steps a batch claims are checked when its call runs, before any rank sees
  it. A step in the future, a step the samplers never served in this line of training (a
  checkpoint load or a recovery starts another), or a loss token without a step is a 422
  naming the field. With ``--max-staleness S`` a training call whose sequences are more than
  S steps behind is refused (409, naming the sequences and their steps) unless it asks for
  ``staleness: "report"``. Either way the result's metrics say how stale the batch was, and
  the staleness of each sequence goes to ``/metrics``.
- ``pace``: a sample request for the newest weights waits while they are more than S steps
  behind the trainer (what it would sample would be refused), until a sync brings newer ones,
  at most its wait, then a retryable 503. A request pinned to a ``step`` is never paced: it
  asked for those weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from trainctl.api import ConflictError, NotReadyError
from trainctl.api.batch import SequenceBatch
from trainctl.api.errors import field_error

Key = str | None
"""Whose steps: an adapter's name, or None for the base model."""

SHOWN = 8
"""Sequences a refusal's message lists (its details list all of them)."""
REMEMBERED = 100_000
"""Steps served that are remembered, of the base and of each adapter: the newest this many
(a bounded table; data older than that is refused as never served)."""


def _whose(key: Key) -> str:
    return "the model" if key is None else f"adapter {key!r}"


class Staleness:
    """Owns the bound, the steps the samplers served in this line of training (of the base
    and of each adapter), and the wake-up of paced samples when a sync brings new weights."""

    def __init__(
        self,
        max_staleness: int | None,
        *,
        tracks_samplers: bool,
        observe: Callable[[np.ndarray], None] = lambda _: None,
    ) -> None:
        self.max = max_staleness
        self.tracks_samplers = tracks_samplers
        """This service's samplers produce the data: a step they never served is unknown. A
        service without samplers takes any step up to the trainer's."""
        self.observe = observe
        """Called with every checked batch's per-sequence staleness (``/metrics``)."""
        self._served: dict[Key, dict[int, None]] = {}
        """Per key, the steps served in this line, in the order they were (a dict: ordered)."""
        self._synced = asyncio.Condition()

    # -- the samplers' side ----------------------------------------------------------------

    async def served(self, key: Key, step: int, new_line: bool = False) -> None:
        """The samplers now serve ``step`` of ``key``; ``new_line``: after a checkpoint load or
        a recovery, whose steps may repeat the old ones with other weights."""
        steps = self._served.setdefault(key, {})
        if new_line:
            steps.clear()
        steps[step] = None
        while len(steps) > REMEMBERED:
            del steps[next(iter(steps))]
        async with self._synced:
            self._synced.notify_all()

    def forget(self, key: Key) -> None:
        """No version of ``key`` is served any more (a deleted adapter, a load on a service
        that syncs on demand)."""
        self._served.pop(key, None)

    async def pace(self, lag: Callable[[], int], wait_s: float, key: Key) -> None:
        """Return once the newest weights the samplers serve of ``key`` are at most the bound
        behind the trainer (``lag()``: steps behind); past ``wait_s``, a retryable 503."""
        if self.max is None or lag() <= self.max:
            return
        deadline = time.monotonic() + wait_s
        async with self._synced:
            while (behind := lag()) > self.max:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotReadyError(
                        f"the samplers serve {_whose(key)} {behind} steps behind the trainer, "
                        f"more than --max-staleness {self.max}: what they would sample now "
                        f"would be refused. Waited {wait_s:g} s for a sync; retry after it "
                        "(POST /v1/weights/sync, or --sampler-sync after_step)",
                        details={"behind": behind, "max_staleness": self.max},
                        retry_after_s=1.0,
                    )
                try:
                    await asyncio.wait_for(self._synced.wait(), left)
                except TimeoutError:
                    continue  # the loop raises

    # -- the trainer's side ----------------------------------------------------------------

    def check(
        self,
        batch: SequenceBatch,
        step: int,
        key: Key = None,
        mode: Literal["refuse", "report"] = "refuse",
        training: bool = True,
    ) -> dict[str, float]:
        """Check the steps ``batch`` claims against the trainer at ``step``; the batch's
        staleness metrics (none if it claims no steps). ``training``: a call that trains (a
        forward-only call is only reported)."""
        steps = batch.column("token_steps")
        if steps is None:
            return {}
        oldest = self._oldest(batch, steps, step, key)
        has = oldest <= step  # sequences with a loss token
        stale = np.where(has, step - oldest, 0)
        metrics = {
            "staleness:max": float(stale[has].max()) if has.any() else 0.0,
            "staleness:mean": float(stale[has].mean()) if has.any() else 0.0,
        }
        if self.max is not None:
            over = np.flatnonzero(has & (stale > self.max))
            metrics["stale_sequences:count"] = float(over.size)
            if over.size and training and mode == "refuse":
                shown = ", ".join(f"sequences[{i}] (step {oldest[i]})" for i in over[:SHOWN])
                more = f" and {over.size - SHOWN} more" if over.size > SHOWN else ""
                raise ConflictError(
                    f"sequences: {over.size} sequence(s) are more than --max-staleness "
                    f"{self.max} steps behind {_whose(key)} at step {step}: {shown}{more}. "
                    "Nothing was applied; sample them again with newer weights, or send "
                    'staleness: "report" to train on them anyway',
                    details={
                        "field": "sequences",
                        "step": step,
                        "max_staleness": self.max,
                        "stale": [[int(i), int(oldest[i])] for i in over],
                    },
                )
        self.observe(stale[has])
        return metrics

    def _oldest(self, batch: SequenceBatch, steps: np.ndarray, step: int, key: Key) -> np.ndarray:
        """Per sequence, the oldest step among its loss tokens (``step + 1`` for a sequence
        without any); a 422 for a step in the future, an unknown one, or a loss token with
        none."""
        future = np.flatnonzero(steps > step)
        if future.size:
            i, j = batch.locate(int(future[0]))
            raise field_error(
                f"sequences[{i}].token_steps[{j}]",
                f"step {steps[future[0]]} is in the future: {_whose(key)} is at step {step}",
            )
        if self.tracks_samplers:
            served = self._served.get(key, {})
            # A batch names a few distinct steps: each is looked up in the table, which is
            # never copied (it may hold REMEMBERED steps).
            never = [s for s in np.unique(steps[steps >= 0]).tolist() if s not in served]
            unknown = np.flatnonzero(np.isin(steps, never))
            if unknown.size:
                i, j = batch.locate(int(unknown[0]))
                listed = sorted(served)
                shown = listed if len(listed) <= SHOWN else [*listed[:2], "...", *listed[-4:]]
                raise field_error(
                    f"sequences[{i}].token_steps[{j}]",
                    f"step {steps[unknown[0]]} of {_whose(key)} was never served by the "
                    f"samplers in this line of training (served: {shown}; a checkpoint load "
                    f"or a recovery starts a new line; the newest {REMEMBERED} are remembered)",
                )
        targets = _targets(batch)
        missing = np.flatnonzero(targets & (steps < 0))
        if missing.size:
            i, j = batch.locate(int(missing[0]))
            raise field_error(
                f"sequences[{i}].token_steps[{j}]",
                f"token {j} is a loss token with no step ({steps[missing[0]]}): token_steps "
                "must cover the completion, every token with loss_mask 1",
            )
        masked = np.where(targets, steps, step + 1)
        return np.minimum.reduceat(masked, batch.offsets[:-1])


def _targets(batch: SequenceBatch) -> np.ndarray:
    """Per token: a loss target (mask 1, not a sequence's first token)."""
    mask = batch.column("loss_mask")
    out = np.ones(batch.num_tokens, bool) if mask is None else mask.astype(bool)
    out[batch.offsets[:-1]] = False
    return out
