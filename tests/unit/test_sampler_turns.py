"""The order of calls on a sampler engine (``workers/sampler/turns.py``): a load goes next
after the samples running, ahead of every waiting sample; samples go in arrival order, those of
one lane together (up to the capacity), a sample of another lane after them and no sample
behind it before it; a waiting sample can be aborted or time out, and neither runs."""

from __future__ import annotations

import asyncio

import pytest

from trainctl.workers.sampler.backend import QueueTimeoutError, RequestAbortedError
from trainctl.workers.sampler.turns import Turns


class _Engine:
    """Records the calls that got a turn, in order; each holds its turn until released."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def sample(
        self, turns: Turns, name: str, timeout: float | None = None, lane: str | None = None
    ) -> str:
        async with turns.sample(name, timeout, lane=lane):
            return await self._run(name)

    async def load(self, turns: Turns, name: str, beside: str | None = None) -> str:
        async with turns.load(beside):
            return await self._run(name)

    async def _run(self, name: str) -> str:
        self.ran.append(name)
        await self.release.setdefault(name, asyncio.Event()).wait()
        return name

    def done(self, name: str) -> None:
        self.release.setdefault(name, asyncio.Event()).set()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_load_goes_next_ahead_of_every_waiting_sample() -> None:
    async def main() -> list[str]:
        turns, engine = Turns(), _Engine()
        running = asyncio.create_task(engine.sample(turns, "s0"))
        await _settle()
        waiting = [asyncio.create_task(engine.sample(turns, f"s{i}")) for i in range(1, 6)]
        await _settle()
        load = asyncio.create_task(engine.load(turns, "load"))
        await _settle()
        assert turns.waiting == 6
        for name in ["s0", "load", *(f"s{i}" for i in range(1, 6))]:
            engine.done(name)
            await _settle()
        await asyncio.gather(running, load, *waiting)
        return engine.ran

    assert asyncio.run(main()) == ["s0", "load", "s1", "s2", "s3", "s4", "s5"]


def test_an_aborted_or_timed_out_sample_never_runs_and_the_next_one_does() -> None:
    async def main() -> tuple[list[str], BaseException | None, BaseException | None]:
        turns, engine = Turns(), _Engine()
        running = asyncio.create_task(engine.sample(turns, "s0"))
        await _settle()
        aborted = asyncio.create_task(engine.sample(turns, "s1"))
        late = asyncio.create_task(engine.sample(turns, "s2", timeout=0.05))
        after = asyncio.create_task(engine.sample(turns, "s3"))
        await _settle()
        assert await turns.abort("s1") is True
        assert await turns.abort("s0") is False  # it holds its turn: it finishes
        await asyncio.sleep(0.2)  # s2's queue timeout passes while s0 still runs
        for name in ("s0", "s2", "s3"):  # s2 too: were it to run, it would end, and fail below
            engine.done(name)
        await asyncio.gather(running, after)
        a, t = await asyncio.gather(aborted, late, return_exceptions=True)
        return (
            engine.ran,
            a if isinstance(a, BaseException) else None,
            (t if isinstance(t, BaseException) else None),
        )

    ran, aborted, late = asyncio.run(main())
    assert ran == ["s0", "s3"]
    assert isinstance(aborted, RequestAbortedError), aborted
    assert isinstance(late, QueueTimeoutError) and late.status == 503, late
    assert "waited 0.05 s" in str(late) and "did not run" in str(late)


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def main() -> list[str]:
        turns, engine = Turns(), _Engine()
        running = asyncio.create_task(engine.sample(turns, "s0"))
        await _settle()
        gone = asyncio.create_task(engine.sample(turns, "s1"))
        nxt = asyncio.create_task(engine.sample(turns, "s2"))
        await _settle()
        gone.cancel()
        await _settle()
        assert turns.waiting == 1
        engine.done("s0")
        engine.done("s2")
        await asyncio.gather(running, nxt)
        with pytest.raises(asyncio.CancelledError):
            await gone
        return engine.ran

    assert asyncio.run(main()) == ["s0", "s2"]


def test_samples_of_one_lane_run_together_and_another_lane_waits_its_turn() -> None:
    """a1, a2 (lane a) run at once; b1 (lane b) waits for both, and a3 (lane a, behind b1)
    waits for b1: a lane never jumps the queue. The capacity bounds a lane."""

    async def main() -> list[list[str]]:
        turns, engine = Turns(capacity=2), _Engine()
        seen = []
        tasks = [
            asyncio.create_task(engine.sample(turns, name, lane=name[0]))
            for name in ("a1", "a2", "a3", "b1", "a4")
        ]
        await _settle()
        seen.append(sorted(turns.running))  # a1, a2: a3 is past the capacity
        engine.done("a1")
        await _settle()
        seen.append(sorted(turns.running))  # a3 joins a2; b1 waits
        engine.done("a2")
        engine.done("a3")
        await _settle()
        seen.append(sorted(turns.running))  # b1 alone; a4 behind it waits
        engine.done("b1")
        await _settle()
        seen.append(sorted(turns.running))
        engine.done("a4")
        await asyncio.gather(*tasks)
        return seen

    assert asyncio.run(main()) == [["a1", "a2"], ["a2", "a3"], ["b1"], ["a4"]]


def test_a_load_waits_for_every_running_sample_and_a_laneless_sample_runs_alone() -> None:
    async def main() -> list[list[str]]:
        turns, engine = Turns(capacity=8), _Engine()
        seen = []
        a = [asyncio.create_task(engine.sample(turns, f"a{i}", lane="a")) for i in range(2)]
        await _settle()
        load = asyncio.create_task(engine.load(turns, "load"))
        late = asyncio.create_task(engine.sample(turns, "a2", lane="a"))
        await _settle()
        seen.append(sorted(turns.running))  # the load waits; a2 waits behind it
        engine.done("a0")
        engine.done("a1")
        await _settle()
        seen.append(list(engine.ran))
        alone = asyncio.create_task(engine.sample(turns, "x"))  # no lane: alone
        engine.done("load")
        await _settle()
        seen.append(sorted(turns.running))
        engine.done("a2")
        await _settle()
        seen.append(sorted(turns.running))
        engine.done("x")
        await asyncio.gather(*a, load, late, alone)
        return seen

    assert asyncio.run(main()) == [
        ["a0", "a1"], ["a0", "a1", "load"], ["a2"], ["x"],
    ]  # fmt: skip


def test_an_in_flight_load_runs_beside_its_lane_and_waits_for_any_other() -> None:
    async def main() -> list[str]:
        turns, engine = Turns(capacity=4), _Engine()
        newest = [asyncio.create_task(engine.sample(turns, f"n{i}", lane="newest")) for i in (0, 1)]
        await _settle()
        beside = asyncio.create_task(engine.load(turns, "load1", beside="newest"))
        await _settle()
        assert engine.ran == ["n0", "n1", "load1"]  # it did not wait for them
        engine.done("load1")
        await beside
        for name in ("n0", "n1"):
            engine.done(name)
        await asyncio.gather(*newest)

        pinned = asyncio.create_task(engine.sample(turns, "p0", lane="step-3"))
        await _settle()
        waits = asyncio.create_task(engine.load(turns, "load2", beside="newest"))
        await _settle()
        assert engine.ran[-1] == "p0"  # a pinned step's sample: the load waits for it
        engine.done("p0")
        await pinned
        await _settle()
        assert engine.ran[-1] == "load2"
        engine.done("load2")
        await waits
        return engine.ran

    assert asyncio.run(main()) == ["n0", "n1", "load1", "p0", "load2"]
