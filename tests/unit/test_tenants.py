"""Tenant keys and what each tenant may see, below the service (``service/tenants.py``, the
Tinker tables): the keys file's format and its reload, and the sampling table's scoping.
The whole thing through a real service: ``tests/service/test_adapters.py``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trainctl.api import (
    AdapterInfo,
    AdapterList,
    ConflictError,
    GoneError,
    NotFoundError,
    OperationKind,
    RateLimitedError,
)
from trainctl.service import tenants
from trainctl.service.shares import Bounds, Shares
from trainctl.service.tinker import state as state_module
from trainctl.service.tinker.adapter_slots import AdapterSlots
from trainctl.service.tinker.sampling_table import PinnedWeights, SamplingSession, SamplingSessions
from trainctl.service.tinker.state import TinkerState

A, B = "a" * 20, "b" * 20


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("alice\n", "line 1: want 'TENANT KEY'"),
        (f"al.ice {A}\n", "line 1: tenant 'al.ice' is not a name"),
        ("alice short\n", "line 1: the key is shorter than 16"),
        (f"alice {A}\nbob {A}\n", "line 2: this key is given twice"),
        ("# nothing\n", "no keys in the file"),
    ],
)
def test_a_keys_file_that_does_not_parse_names_the_line(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        tenants.parse_keys(text)


def test_keys_are_read_again_when_the_file_changes_and_every_reload_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change takes effect; a bad line grants nothing while the good lines' removals take
    effect; an empty, comment-only, unreadable or deleted file revokes every key. Each
    reload's outcome is counted."""
    path = tmp_path / "keys"
    path.write_text(f"alice {A}  # a comment\nbob {B}\n")
    keys = tenants.TenantKeys(path)
    assert (keys.tenant_of(A), keys.tenant_of(B), keys.tenant_of("c" * 20)) == (
        "alice",
        "bob",
        None,
    )
    monkeypatch.setattr(tenants, "RECHECK_S", 0.0)
    later = iter(range(1, 100))

    def write(text: str) -> None:
        path.write_text(text)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + next(later) * 10**9))

    write(f"carol {B}\n")
    assert (keys.tenant_of(A), keys.tenant_of(B)) == (None, "carol")
    write(f"alice {A}\ndave short\n")  # carol revoked beside a typo: she is out
    assert (keys.tenant_of(A), keys.tenant_of(B)) == ("alice", None)
    assert keys.outcomes == {"applied": 1, "partial": 1, "revoked": 0}
    for text in ("", "# nobody\n\n"):
        write(f"alice {A}\n")
        assert keys.tenant_of(A) == "alice"
        write(text)
        assert keys.tenant_of(A) is None and keys.tenants == set()
    write(f"alice {A}\n")
    assert keys.tenant_of(A) == "alice"
    path.unlink()  # a Secret withdrawn (an unreadable file reads the same: no keys)
    assert keys.tenant_of(A) is None and keys.tenants == set()
    assert keys.outcomes["revoked"] == 3
    write(f"alice {A}\n")  # back: the keys are valid again
    assert keys.tenant_of(A) == "alice"


def test_a_key_given_twice_grants_neither_holder() -> None:
    keys, problems = tenants.read_keys(f"alice {A}\nbob {A}\ncarol {B}\ndave {A}\n")
    assert keys == {B: "carol"}
    assert problems == [f"api_keys: line {n}: this key is given twice" for n in (2, 4)]


def test_another_tenants_sessions_models_futures_and_paths_are_unknown() -> None:
    state = TinkerState()
    mine = state.create_session("alice")
    model = state.add_model(mine, 0, adapter="alice.x")
    assert model.tenant == "alice" and model.native == f"alice.{mine}-train-0"
    f = state.new_future("create_model", "alice")
    for lookup in (
        lambda: state.session(mine, "bob"),
        lambda: state.model(model.model_id, "bob"),
        lambda: state.future(f.id, "bob"),
    ):
        with pytest.raises(NotFoundError):
            lookup()
    assert state.find_model(model.model_id, "bob") is None
    assert state.model(model.model_id, "alice") is model  # its own
    assert state.model(model.model_id, None) is model  # the operator sees everything
    table = SamplingSessions({})
    table.add(SamplingSession(f"{mine}:sample:0", "m", None, step=1, tenant="alice"))
    table.remember_path(
        "tinker://p/sampler_weights/final", PinnedWeights("alice.x", 1, None, "alice")
    )
    with pytest.raises(NotFoundError):
        table.get(f"{mine}:sample:0", "bob")
    with pytest.raises(NotFoundError):
        table.pinned("tinker://p/sampler_weights/final", "bob")
    assert table.get(f"{mine}:sample:0", "alice").step == 1
    assert table.pinned("tinker://p/sampler_weights/final", "alice").adapter == "alice.x"


# -- fair shares (service/shares.py) -------------------------------------------------------------

SMALL = Bounds(sessions=64, models=64, futures=256, sampling_clients=128, parked=32,
               samples=16)  # fmt: skip
"""With three tenants and the operator (4 parties): 16 sessions, 32 sampling clients, 8
parked requests and 4 samples in flight each."""


def _three_tenants(bounds: Bounds = SMALL) -> TinkerState:
    return TinkerState(order_timeout_s=5, shares=Shares(bounds, lambda: 3))


def test_the_share_is_the_bound_over_the_parties_with_a_floor() -> None:
    assert Shares(Bounds(sessions=1024), lambda: 3).of("sessions") == 256
    assert Shares(Bounds(sessions=1024)).of("sessions") == 1024  # no tenants: the operator's
    assert Shares(Bounds(sessions=1024), lambda: 999).of("sessions") == 4  # the floor
    assert Shares(Bounds(sessions=2), lambda: 999).of("sessions") == 2  # never above the bound
    assert Shares(Bounds(), lambda: 3).of("adapters", 3) == 1  # at least one adapter each
    assert "share is 16 of --tinker-max-sessions 64 over 4 parties" in Shares(
        SMALL, lambda: 3
    ).describe("sessions")


def test_a_tenant_flooding_sessions_evicts_only_its_own_and_is_refused_while_they_live() -> None:
    state = _three_tenants()
    alice, bob = state.create_session("alice"), state.create_session("bob")
    carol = [state.create_session("carol") for _ in range(16)]
    with pytest.raises(RateLimitedError, match=r"tenant 'carol' holds 16 Tinker sessions.*"
                       r"share is 16 of --tinker-max-sessions 64 over 4 parties") as e:  # fmt: skip
        state.create_session("carol")
    assert e.value.status == 429 and e.value.details["share"] == 16
    state.silent_s = 0.0  # carol's sessions fall silent: her own oldest make room
    for _ in range(100):
        state.create_session("carol")
    assert state.session(alice, "alice") and state.session(bob, "bob")
    assert sum(s.tenant == "carol" for s in state.sessions.values()) == 16
    assert carol[0] not in state.sessions
    assert state.shares.evicted["carol", "sessions"] == 100
    assert state.shares.refused["carol", "sessions"] == 1
    assert ("alice", "sessions") not in state.shares.evicted


def test_model_handles_are_bounded_per_tenant_with_a_409() -> None:
    state = _three_tenants(Bounds(models=64))  # 16 each
    sessions = [state.create_session("carol") for _ in range(4)]
    for i in range(16):
        state.add_model(sessions[i % 4], i)
    with pytest.raises(ConflictError, match=r"tenant 'carol' holds 16 Tinker model handles"):
        state.add_model(sessions[0], 99)
    state.add_model(sessions[0], 0)  # an existing handle needs no room
    alice = state.create_session("alice")
    assert state.add_model(alice, 0).tenant == "alice"


def test_sampling_clients_past_the_share_drop_the_tenants_own_least_recent() -> None:
    state = _three_tenants()
    table = SamplingSessions(state.evicted, state.shares)
    table.add(SamplingSession("a:sample:0", "m", None, step=1, tenant="alice"))
    for i in range(40):
        table.add(SamplingSession(f"c:sample:{i}", "m", None, step=1, tenant="carol"))
        if i == 10:
            table.get("c:sample:0", "carol")  # used: carol's last to go
    assert table.count("carol") == 32 and table.get("a:sample:0", "alice").step == 1
    assert table.get("c:sample:0", "carol").step == 1
    with pytest.raises(NotFoundError):
        table.get("c:sample:1", "carol")
    assert state.shares.evicted["carol", "sampling_clients"] == 8
    for i in range(40):
        pinned = PinnedWeights(None, i, None, "carol")
        table.remember_path(f"tinker://c/sampler_weights/{i}", pinned)
    table.remember_path("tinker://a/sampler_weights/x", PinnedWeights(None, 1, None, "alice"))
    assert table.pinned("tinker://a/sampler_weights/x", "alice").step == 1
    assert len(table.sampler_paths) == 33


def test_a_tenants_parked_requests_never_crowd_out_another_tenants() -> None:
    async def run() -> None:
        state = _three_tenants()
        carol = state.add_model(state.create_session("carol"), 0)
        parked = [state.submit(carol, 2 + i, str(i), "x", _never) for i in range(8)]
        with pytest.raises(RateLimitedError, match=r"tenant 'carol' has 8 requests parked.*"
                           r"share is 8 of --tinker-max-parked 32"):  # fmt: skip
            state.submit(carol, 10, "z", "x", _never)
        alice = state.add_model(state.create_session("alice"), 0)
        mine = [state.submit(alice, 2 + i, str(i), "x", _never) for i in range(8)]
        await asyncio.sleep(0.01)
        assert state.parked == {"carol": 8, "alice": 8}
        assert len(parked) == len(mine) == 8

    asyncio.run(run())


def test_a_request_far_ahead_of_its_turn_parks_only_briefly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_module, "FAR_AHEAD_WAIT_S", 0.05)

    async def run() -> None:
        state = _three_tenants()
        state.order_timeout_s = 30
        carol = state.add_model(state.create_session("carol"), 0)
        near = state.submit(carol, 3, "a", "x", _never)  # one ahead: a pipelining client
        far = state.submit(carol, 300, "b", "x", _never)
        await asyncio.wait_for(far.done.wait(), 2)
        assert far.error is not None and "waited 0.05 s for seq_id 1" in far.error[0]
        assert not near.done.is_set() and state.parked["carol"] == 1

    asyncio.run(run())


def test_finished_futures_past_the_share_drop_the_tenants_own_oldest() -> None:
    state = _three_tenants(Bounds(futures=256))  # 64 each
    alice = state.new_future("x", "alice")
    alice.finish(1)
    for _ in range(100):
        state.new_future("x", "carol").finish(1)
    assert state.future(alice.id, "alice") is alice
    assert sum(f.tenant == "carol" for f in state.futures.values()) == 64
    assert state.shares.evicted["carol", "futures"] == 36


def test_samples_in_flight_are_bounded_per_tenant() -> None:
    async def run() -> None:
        state = _three_tenants()
        gate = asyncio.Event()

        async def held() -> int:
            await gate.wait()
            return 1

        running = [state.sample(held, "carol") for _ in range(4)]
        with pytest.raises(RateLimitedError, match=r"tenant 'carol' has 4 samples in flight"):
            state.sample(held, "carol")
        alice = state.sample(held, "alice")
        gate.set()
        await asyncio.wait_for(alice.done.wait(), 2)
        await asyncio.gather(*(f.done.wait() for f in running))
        assert state.sampling["carol"] == 0
        state.sample(held, "carol")  # room again

    asyncio.run(run())


def test_a_finished_session_releases_its_models_once_and_refuses_them_after() -> None:
    state = _three_tenants()
    released: list[list[str]] = []
    state.on_release = lambda s, models: released.append([m.model_id for m in models])
    sid = state.create_session("alice")
    model = state.add_model(sid, 0, adapter="alice.x")
    assert state.live_adapters("alice") == {"alice.x"} and state.live_adapters("bob") == set()
    state.finish(state.session(sid, "alice"), "success")
    state.finish(state.session(sid, "alice", finished=True), "errored")  # the first wins
    assert released == [[model.model_id]] and state.sessions[sid].finished == "success"
    table = SamplingSessions({}, state.shares, finished=state.finish_reason)
    with pytest.raises(GoneError, match=f"belongs to session {sid}, which finished"):
        table.get(f"{sid}:sample:0", "alice")
    assert state.live_adapters("alice") == set()
    with pytest.raises(GoneError, match="finished \\(success\\)"):
        state.model(model.model_id, "alice")
    with pytest.raises(GoneError):
        state.add_model(sid, 1)
    state.silent_s = 0.0
    other = state.create_session("bob")
    state.add_model(other, 0, adapter="bob.y")
    state.session_ttl_s = -1.0  # every session expires: bob's models are released on the way
    state.expire_sessions()
    assert released[-1] == [f"{other}:train:0"] and len(released) == 2  # alice's not again


async def _never() -> Any:
    await asyncio.Event().wait()


def test_a_tenants_burst_waits_for_its_own_share_of_the_operation_queue() -> None:
    """carol's requests past her share of the controller's queue wait for her own to finish;
    alice's go straight in."""

    async def run() -> None:
        state = _three_tenants(Bounds(operations=8))  # 2 each
        gates: list[asyncio.Event] = []
        admitted: list[str] = []

        def admit(who: str) -> Any:
            async def go() -> Any:
                admitted.append(who)
                gate = asyncio.Event()
                gates.append(gate)

                async def finish() -> str:
                    await gate.wait()
                    return who

                return finish()

            return go

        carol = state.add_model(state.create_session("carol"), 0)
        futures = [state.submit(carol, i, str(i), "x", admit(f"carol{i}")) for i in (1, 2, 3)]
        await asyncio.sleep(0.05)
        assert admitted == ["carol1", "carol2"] and state.admitted["carol"] == 2
        alice = state.add_model(state.create_session("alice"), 0)
        mine = state.submit(alice, 1, "a", "x", admit("alice1"))
        await asyncio.sleep(0.05)
        assert admitted[-1] == "alice1" and "carol3" not in admitted
        gates[0].set()  # carol's first finishes: her third goes in
        await asyncio.wait_for(futures[0].done.wait(), 2)
        await asyncio.sleep(0.05)
        assert admitted[-1] == "carol3"
        for g in gates:
            g.set()
        await asyncio.wait_for(mine.done.wait(), 2)
        await asyncio.gather(*(asyncio.wait_for(f.done.wait(), 2) for f in futures))
        await asyncio.sleep(0.01)
        assert state.admitted["carol"] == 0 and state.admitted["alice"] == 0

    asyncio.run(run())


class _AdapterTable:
    """The controller's adapter table, as the adapter slots see it (list, delete)."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters, self.names = max_adapters, set[str]()

    async def list_adapters(self) -> AdapterList:
        spec = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": [], "step": 0, "bytes": 1}
        infos = [AdapterInfo(name=n, last_used=0.0, **spec) for n in sorted(self.names)]
        return AdapterList(adapters=infos, max_adapters=self.max_adapters, max_rank=8)

    async def run(self, kind: Any, req: Any, key: Any = None, fingerprint: str = "") -> Any:
        assert kind is OperationKind.DELETE_ADAPTER
        if req.name not in self.names:
            raise NotFoundError(f"adapter {req.name!r} does not exist")
        self.names.discard(req.name)
        return await self.list_adapters()


def test_adapter_slots_hold_a_quota_per_tenant_and_come_back_with_their_sessions() -> None:
    """Each tenant's quota of --max-adapters 4 (three tenants and the operator: one each):
    another tenant's adapters never count; a load still to run holds its slot; an adapter no
    live model trains (a finished session's, a gateway restart's) is freed when the room is
    needed; a finished session's are freed in the background."""

    async def run() -> None:
        state = _three_tenants()
        table = _AdapterTable(max_adapters=4)
        slots = AdapterSlots(lambda: table, state)  # type: ignore[arg-type, return-value]
        state.on_release = lambda s, models: slots.release(models)
        alice = state.create_session("alice")
        async with slots.room("alice"):
            model = state.add_model(alice, 0, adapter=f"alice.{alice}-train-0")
            table.names.add(model.adapter or "")
        table.names.add(f"bob.{'b' * 16}-train-0")  # bob's: not alice's to count
        with pytest.raises(ConflictError, match=r"tenant 'alice' holds 1 LoRA adapters.*share "
                           r"is 1 of --max-adapters 4 over 4 parties"):  # fmt: skip
            async with slots.room("alice"):
                pass
        # carol's load of a saved state: its adapter exists only once the load runs
        carol = state.create_session("carol")
        async with slots.room("carol"):
            loading = state.add_model(carol, 0, first_seq=0, adapter=f"carol.{carol}-train-0")
        done = asyncio.Event()
        slots.pending_until("carol", loading.adapter or "", done)
        with pytest.raises(ConflictError, match="tenant 'carol' holds 1"):
            async with slots.room("carol"):
                pass
        done.set()
        await asyncio.sleep(0.01)  # the load failed: nothing was made, the slot is free
        async with slots.room("carol"):
            pass
        # alice's session finishes: her adapter goes, in the background
        state.finish(state.session(alice, "alice"), "success")
        await asyncio.gather(*slots.releasing)
        assert table.names == {f"bob.{'b' * 16}-train-0"}
        # an adapter no live model trains (left by a restart): freed when alice needs room
        table.names.add(f"alice.{'c' * 16}-train-3")
        async with slots.room("alice"):
            pass
        assert f"alice.{'c' * 16}-train-3" not in table.names
        assert state.shares.refused["alice", "adapters"] == 1

    asyncio.run(run())


def test_an_open_metrics_scrape_names_no_tenant() -> None:
    """``/metrics`` answers without the token by default: every tenant label there is a
    pseudonym, stable for the gateway's life; the operator's label stays."""
    from trainctl.service.metrics import pseudonymous_tenants

    text = (
        b'trainctl_tenant_requests_total{tenant="alice"} 3.0\n'
        b'trainctl_tenant_refusals_total{table="sessions",tenant="_operator"} 1.0\n'
        b'trainctl_tenant_adapters{tenant="alice"} 1.0\n'
    )
    out = pseudonymous_tenants(text, b"s" * 32).decode()
    assert "alice" not in out and 'tenant="_operator"' in out
    names = {line.split('tenant="')[1].split('"')[0] for line in out.splitlines()}
    assert len(names) == 2 and any(n.startswith("t-") and len(n) == 14 for n in names)
    assert pseudonymous_tenants(text, b"s" * 32).decode() == out  # the same series each time
    assert pseudonymous_tenants(text, b"t" * 32).decode() != out  # another gateway's secret
