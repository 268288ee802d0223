"""The window of weight versions (``workers/sampler/window.py``): the newest K syncs of the
base and of each adapter stay servable; a step past the window is a 410 naming it and the
oldest served, a step not synced yet a 409, one never synced in between a 404; a new line of
training (a checkpoint load) empties it."""

from __future__ import annotations

import pytest

from trainctl.api import ConflictError, GoneError, NotFoundError, NotReadyError, SampleRequest
from trainctl.workers.sampler.pool import PoolOptions, SamplerPool
from trainctl.workers.sampler.spec import SamplerSpec
from trainctl.workers.sampler.transport import Shipment
from trainctl.workers.sampler.window import VersionWindow


def _ship(step: int, adapter: str | None = None) -> Shipment:
    return Shipment("local", step, adapter, nbytes=10, handle=None)


def test_the_newest_k_versions_are_served_and_an_older_one_is_a_410() -> None:
    w = VersionWindow(2)
    s0, s1, s2 = _ship(0), _ship(1), _ship(2)
    assert w.publish(s0) == [] and w.publish(s1) == []
    assert w.get(None, 0) is s0 and w.get(None, None) is s1
    assert w.publish(s2) == [s0]
    assert w.steps(None) == [1, 2] and w.nbytes() == 20
    with pytest.raises(
        GoneError, match=r"step 0 .* left the samplers' window .* oldest served is step 1"
    ):
        w.get(None, 0)
    with pytest.raises(ConflictError, match="step 3 is not synced yet"):
        w.get(None, 3)
    assert w.get(None, 1) is s1 and w.get(None, 2) is s2


def test_a_step_never_synced_inside_the_window_is_a_404() -> None:
    w = VersionWindow(3)
    w.publish(_ship(0))
    w.publish(_ship(2))  # manual sync: step 1 was never published
    with pytest.raises(NotFoundError, match=r"step 1 .* never synced.*\[0, 2\]"):
        w.get(None, 1)


def test_adapters_have_windows_of_their_own() -> None:
    w = VersionWindow(2)
    w.publish(_ship(5))
    for step in (0, 1, 2):
        w.publish(_ship(step, "a"))
    w.publish(_ship(0, "b"))
    assert (w.steps(None), w.steps("a"), w.steps("b")) == ([5], [1, 2], [0])
    with pytest.raises(GoneError, match="adapter 'a'"):
        w.get("a", 0)
    w.restart("a")  # deleted
    with pytest.raises(NotFoundError, match="no adapter 'a'"):
        w.get("a", None)
    assert w.get("b", 0).version == 0


def test_a_new_line_of_training_empties_the_window() -> None:
    w = VersionWindow(3)
    old = [_ship(s) for s in (1, 2, 3)]
    for s in old:
        w.publish(s)
    again = _ship(2)  # a checkpoint of step 2 loaded: its step 3 will be other weights
    assert w.publish(again, new_line=True) == old
    assert w.steps(None) == [2] and w.get(None, 2) is again
    three = _ship(3)
    w.publish(three)
    assert w.publish(_ship(1)) == [again, three]  # older than the newest: a new line too
    assert w.steps(None) == [1]


def test_a_version_synced_again_replaces_its_copy_and_a_refused_one_is_withdrawn() -> None:
    w = VersionWindow(2)
    first, second = _ship(4), _ship(4)
    w.publish(first)
    assert w.publish(second) == [first] and w.get(None, 4) is second
    refused = _ship(5)
    w.publish(refused)
    w.withdraw(refused, second)
    assert w.steps(None) == [4] and w.get(None, None) is second


def test_nothing_synced_is_not_ready() -> None:
    with pytest.raises(NotReadyError, match="no weights yet"):
        VersionWindow(2).get(None, None)


def _pool(engines: list[tuple[int, int]]) -> SamplerPool:
    """A pool (no engines started) whose engines hold these (base step, requests in flight)."""
    pool = SamplerPool(SamplerSpec(hf_config={}), PoolOptions(num_samplers=len(engines)))
    for e, (step, in_flight) in zip(pool.engines, engines, strict=True):
        e.status, e.step, e.in_flight = "ready", step, in_flight
    for step in (0, 1):
        pool.window.publish(_ship(step))
    return pool


def test_a_request_goes_where_its_version_is_unless_that_engine_is_busier() -> None:
    """An engine that would have to load the version asked for counts one request more."""
    pool = _pool([(0, 0), (1, 0)])
    at = {s: pool._pick(pool.version_of(SampleRequest(prompts=[[1]], step=s))).index
          for s in (0, 1)}  # fmt: skip
    assert at == {0: 0, 1: 1}
    pool = _pool([(0, 2), (1, 0)])  # the engine holding step 0 has two in flight
    step0 = pool.window.get(None, 0)
    assert pool._pick(step0).index == 1  # one swap (1 + 0) beats waiting behind two
    pool = _pool([(0, 1), (1, 0)])
    step0 = pool.window.get(None, 0)
    assert pool._pick(step0).index == 0  # a tie (1 in flight, or 0 and a swap): the lower index


def test_a_broadcast_version_goes_only_to_an_engine_that_kept_it() -> None:
    """A version that came over the collective cannot be loaded again: a request for it goes
    to an engine that keeps it, however busy, and is a 410 once none does."""
    pool = _pool([(1, 3), (1, 0)])
    pinned = Shipment("collective", 0, None, 1, None)
    pool.window.publish(pinned, new_line=True)
    pool.window.publish(Shipment("collective", 1, None, 1, None))
    pool.engines[0].kept = [pinned.id]  # engine 1 was recreated after step 0
    assert pool._pick(pinned).index == 0
    pool.engines[0].kept = []
    with pytest.raises(GoneError, match="no sampler engine keeps the weights of step 0"):
        pool._pick(pinned)


def test_expected_step_is_checked_against_the_version_sampled() -> None:
    pool = _pool([(1, 0)])
    assert pool.version_of(SampleRequest(prompts=[[1]], step=0, expected_step=0)).version == 0
    with pytest.raises(ConflictError, match="step 1, not 0"):
        pool.version_of(SampleRequest(prompts=[[1]], expected_step=0))
