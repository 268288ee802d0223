"""Tenant keys and what each tenant may see, below the service (``service/tenants.py``, the
Tinker tables): the keys file's format and its reload, and the sampling table's scoping.
The whole thing through a real service: ``tests/service/test_adapters.py``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trainctl.api import NotFoundError
from trainctl.service import tenants
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


def test_keys_are_read_again_when_the_file_changes_and_a_broken_file_keeps_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice {A}  # a comment\nbob {B}\n")
    keys = tenants.TenantKeys(path)
    assert (keys.tenant_of(A), keys.tenant_of(B), keys.tenant_of("c" * 20)) == (
        "alice",
        "bob",
        None,
    )
    monkeypatch.setattr(tenants, "RECHECK_S", 0.0)
    path.write_text(f"carol {B}\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later mtime, surely
    assert (keys.tenant_of(A), keys.tenant_of(B)) == (None, "carol")
    path.write_text("carol\n")  # broken: the keys read before stay
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert keys.tenant_of(B) == "carol" and keys.tenants == {"carol"}


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
