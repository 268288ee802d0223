"""A call is planned when it is submitted (a batch the layout cannot take is refused before
it queues), but runs on the layout the ranks have when its turn comes: a lost node shrinks
the layout (``--on-node-loss shrink``) while calls wait behind the rebuild, and a plan for
three DP replicas run by two would silently drop the third replica's sequences."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from trainctl.api import Operation, OperationKind, OperationStatus, TrainBatchRequest
from trainctl.workers.control.op_queue import Handle
from trainctl.workers.control.plan import StepPlan
from trainctl.workers.control.steps import ModelState, Steps
from trainctl.workers.engine.config import EngineConfig

from helpers.batches import sft_shared_batch


class _Sent(Exception):
    """The plan reached the ranks: all this test reads."""


class _Ranks:
    """A group whose layout the test changes; it keeps the plan it is sent."""

    def __init__(self, dp: int) -> None:
        self.cfg = EngineConfig.from_dict({"layout": {"dp": dp}})
        self.sent: list[StepPlan] = []

    def put(self, value: Any) -> Any:
        self.sent.append(value)
        return value

    async def call(self, method: Any, *args: Any) -> list[Any]:
        raise _Sent

    async def call_quietly(self, method: Any) -> None:
        return None


async def _no_hook(h: Handle, adapter: str | None) -> list[str]:
    return []


def _run(steps: Steps, run: Any) -> None:
    op = Operation(
        id="op-1", kind=OperationKind.TRAIN_BATCH, status=OperationStatus.RUNNING, created_at=0.0
    )
    try:
        asyncio.run(run(Handle(op=op, run=None, key=None, fingerprint="")))
    except _Sent:
        return
    raise AssertionError("the call never sent its plan")


def test_a_call_queued_before_the_layout_shrank_runs_a_plan_for_the_new_layout() -> None:
    ranks = _Ranks(dp=3)
    steps = Steps(ranks, ModelState(), after_train=_no_hook)
    req = TrainBatchRequest(sequences=sft_shared_batch(seed=3), packing="flat")
    run = steps.train(req)  # planned now, for dp3
    ranks.cfg = dataclasses.replace(ranks.cfg, layout=dataclasses.replace(ranks.cfg.layout, dp=2))
    _run(steps, run)
    plan = ranks.sent[-1]
    assert len(plan.microbatches) == 2  # one list per DP replica the ranks now have
    sent = sorted(int(i) for rank in plan.microbatches for mb in rank for i in mb.seq_index)
    assert [i for i in sent if i >= 0] == list(
        range(len(req.sequences))
    )  # every sequence, none dropped


def test_a_call_whose_layout_did_not_change_runs_the_plan_made_at_submit() -> None:
    ranks = _Ranks(dp=3)
    steps = Steps(ranks, ModelState(), after_train=_no_hook)
    run = steps.train(TrainBatchRequest(sequences=sft_shared_batch(seed=3)))
    _run(steps, run)
    _run(steps, run)
    assert len(ranks.sent) == 2 and ranks.sent[0] is ranks.sent[1]  # planned once
