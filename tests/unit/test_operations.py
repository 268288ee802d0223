"""The operation queue: arrival order, idempotency, the queue limit, failures, eviction."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from trainctl.api import (
    ConflictError,
    NotReadyError,
    OperationStatus,
    RateLimitedError,
    WorkerError,
)
from trainctl.workers.control.op_queue import Handle, OperationQueue


class Model:
    """Counts applied steps; each step takes a little while so calls overlap."""

    def __init__(self) -> None:
        self.step = 0
        self.order: list[str] = []

    def runner(self, name: str, delay: float = 0.01, fail: Exception | None = None) -> Any:
        async def run(h: Handle) -> int:
            h.set_phase("stepping")
            await asyncio.sleep(delay)
            if fail is not None:
                raise fail
            self.order.append(name)
            self.step += 1
            return self.step

        return run


def test_operations_run_one_at_a_time_in_arrival_order() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        ops = [q.submit("train_batch", m.runner(f"c{i}"), key=f"k{i}") for i in range(8)]
        assert [op.queue_position for op in ops] == list(range(8))
        results = await asyncio.gather(*(q.result(op.id) for op in ops))
        assert results == list(range(1, 9)) and m.order == [f"c{i}" for i in range(8)]
        assert q.get(ops[0].id).status is OperationStatus.DONE

    asyncio.run(main())


def test_a_retry_with_the_same_key_never_steps_twice() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        first = q.submit("train_batch", m.runner("a", delay=0.05), key="k", fingerprint="f")
        await asyncio.sleep(0.01)  # the first is now running
        again = q.submit("train_batch", m.runner("a"), key="k", fingerprint="f")
        assert again.id == first.id and again.status is OperationStatus.RUNNING
        assert again.phase == "stepping"
        assert await q.result(first.id) == 1
        late = q.submit("train_batch", m.runner("a"), key="k", fingerprint="f")
        assert late.id == first.id and late.status is OperationStatus.DONE and late.result == 1
        assert m.step == 1

    asyncio.run(main())


def test_the_same_key_for_another_request_is_a_conflict() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        q.submit("train_batch", m.runner("a"), key="k", fingerprint="f1")
        with pytest.raises(ConflictError, match="different train_batch request"):
            q.submit("train_batch", m.runner("b"), key="k", fingerprint="f2")
        with pytest.raises(ConflictError):
            q.submit("eval_batch", m.runner("b"), key="k", fingerprint="f1")

    asyncio.run(main())


def test_a_full_queue_answers_rate_limited_with_a_retry_delay() -> None:
    async def main() -> None:
        q, m = OperationQueue(max_queued=2), Model()
        ops = [q.submit("train_batch", m.runner(str(i), delay=0.02)) for i in range(2)]
        with pytest.raises(RateLimitedError) as e:
            q.submit("train_batch", m.runner("x"))
        assert e.value.status == 429 and e.value.retry_after_s is not None
        await q.idle()
        assert m.step == 2 and all(q.get(op.id).finished for op in ops)
        q.submit("train_batch", m.runner("y"))  # room again

    asyncio.run(main())


def test_the_queues_retry_delay_survives_the_trip_to_the_gateway() -> None:
    """The delay is the queue's estimate (8 s runs, 2 queued: 4 s), not the class's 1 s,
    and it survives pickling, as the error crosses from the controller actor through Ray."""
    import pickle

    async def main() -> None:
        q, m = OperationQueue(max_queued=2, avg_run_s=8.0), Model()
        for i in range(2):
            q.submit("train_batch", m.runner(str(i), delay=0.02))
        with pytest.raises(RateLimitedError) as e:
            q.submit("train_batch", m.runner("x"))
        crossed = pickle.loads(pickle.dumps(e.value))
        assert (e.value.retry_after_s, crossed.retry_after_s) == (4.0, 4.0)
        assert type(crossed) is RateLimitedError and crossed.message == e.value.message
        await q.idle()

    asyncio.run(main())


def test_a_retryable_failure_frees_the_key_and_a_final_one_keeps_it() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        op = q.submit("train_batch", m.runner("a", fail=WorkerError("rank 1 died")), key="k")
        with pytest.raises(WorkerError, match="rank 1 died"):
            await q.result(op.id)
        failed = q.get(op.id)
        assert failed.status is OperationStatus.FAILED and failed.error is not None
        assert failed.error.type.value == "worker_error"
        retry = q.submit("train_batch", m.runner("a"), key="k")
        assert retry.id != op.id and await q.result(retry.id) == 1

        stale = ConflictError("expected_step is 0 but the model is at step 1")
        op2 = q.submit("train_batch", m.runner("b", fail=stale), key="k2")
        with pytest.raises(ConflictError):
            await q.result(op2.id)
        assert q.submit("train_batch", m.runner("b"), key="k2").id == op2.id

    asyncio.run(main())


def test_an_unexpected_exception_fails_the_operation_and_the_queue_goes_on() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        bad = q.submit("train_batch", m.runner("a", fail=KeyError("boom")))
        good = q.submit("train_batch", m.runner("b"))
        with pytest.raises(Exception, match="KeyError"):
            await q.result(bad.id)
        assert await q.result(good.id) == 1

    asyncio.run(main())


def test_draining_fails_what_is_queued_but_lets_the_running_one_finish() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        running = q.submit("train_batch", m.runner("a", delay=0.05))
        queued = q.submit("train_batch", m.runner("b"))
        await asyncio.sleep(0.01)
        assert q.fail_pending(NotReadyError("shutting down")) == 1
        await q.idle()
        assert q.get(running.id).status is OperationStatus.DONE
        assert q.get(queued.id).status is OperationStatus.FAILED and m.order == ["a"]

    asyncio.run(main())


def test_finished_operations_are_evicted_oldest_first() -> None:
    async def main() -> None:
        q, m = OperationQueue(keep_finished=3), Model()
        ops = [q.submit("eval_batch", m.runner(str(i), delay=0), key=f"k{i}") for i in range(5)]
        await q.idle()
        for op in ops[:2]:
            with pytest.raises(Exception, match="unknown"):
                q.get(op.id)
        assert all(q.get(op.id).finished for op in ops[2:])
        # An evicted key is forgotten with its operation: the same key runs again.
        assert q.submit("eval_batch", m.runner("again", delay=0), key="k0").id != ops[0].id

    asyncio.run(main())


def test_wait_returns_the_running_state_after_the_timeout() -> None:
    async def main() -> None:
        q, m = OperationQueue(), Model()
        op = q.submit("train_batch", m.runner("a", delay=0.2))
        await asyncio.sleep(0.01)
        snap = await q.wait(op.id, timeout=0.01)
        assert snap.status is OperationStatus.RUNNING and snap.started_at is not None
        done = await q.wait(op.id, timeout=5)
        assert done.status is OperationStatus.DONE and done.finished_at is not None

    asyncio.run(main())


def test_a_finished_operation_lets_go_of_its_request_and_plan() -> None:
    """The review's case: finished operations kept their request and plan, and the
    controller's memory stayed high; only the result is kept for polling."""
    import gc
    import weakref

    class Plan:
        """Stands for the request and the plan a runner closes over."""

    async def main() -> None:
        q = OperationQueue()
        plans, ops = [], []
        for fail in (None, WorkerError("rank 0 failed")):
            plan = Plan()
            plans.append(weakref.ref(plan))

            async def run(h: Handle, plan: Plan = plan, fail: Exception | None = fail) -> int:
                if fail is not None:
                    raise fail
                return id(plan)

            ops.append(q.submit("train_batch", run, key=f"k{len(ops)}"))
            del plan, run
        await q.idle()
        gc.collect()
        assert [p() for p in plans] == [None, None]
        assert q.get(ops[0].id).result is not None  # the result stays for polling

    asyncio.run(main())


def test_evicted_operations_are_counted() -> None:
    from trainctl.workers.control.telemetry import ControllerMetrics

    async def main() -> None:
        q, m = OperationQueue(keep_finished=3), Model()
        metrics = ControllerMetrics(lambda: q.depth, lambda: q.evicted)
        for i in range(5):
            q.submit("train_batch", m.runner(str(i), delay=0), key=f"k{i}")
        await q.idle()
        assert q.evicted == 2
        assert 'trainctl_controller_evictions{table="finished_operations"} 2.0' in (
            metrics.text().decode()
        )
        # An evicted operation's key went with it; a kept one's still guards its request.
        q.submit("train_batch", m.runner("again", delay=0), key="k0", fingerprint="other")
        with pytest.raises(ConflictError):
            q.submit("train_batch", m.runner("again", delay=0), key="k4", fingerprint="other")
        await q.idle()

    asyncio.run(main())
