"""The test harness's resource lifetimes (``helpers/tiers.py``): a session service handed to
``until_last_use`` closes right after the last test that asks for its fixture, not at the
end of its tier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from helpers import tiers


@dataclass
class _Item:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)


def test_a_resource_closes_after_its_last_user_and_not_before() -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def service(name: str) -> Iterator[str]:
        events.append(f"open {name}")
        yield name
        events.append(f"close {name}")

    items = [
        _Item("a", ["lora"]),
        _Item("b", ["lora", "tmp_path"]),
        _Item("c", ["sampled"]),
        _Item("d", ["sampled"]),
    ]
    tiers.record_last_uses(items)  # type: ignore[arg-type]
    with contextlib.ExitStack() as fixtures:  # pytest's own teardown, at the session's end
        fixtures.enter_context(tiers.until_last_use("lora", "t", service("lora")))
        tiers.end_uses("a")
        assert events == ["open lora"]  # "b" still uses it
        tiers.end_uses("b")
        assert events == ["open lora", "close lora"]
        fixtures.enter_context(tiers.until_last_use("sampled", "t", service("sampled")))
        tiers.end_uses("c")
        assert events[-1] == "open sampled"
        tiers.end_tier("t")  # the tier ends first: it closes what is still open, once
        assert events[-1] == "close sampled"
        tiers.end_uses("d")
    assert events == ["open lora", "close lora", "open sampled", "close sampled"]
