"""The docs cannot drift from the tree: every relative link resolves (to a file, and to a
heading when it names one), and every `trainctl serve` flag is documented."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from trainctl.service.cli import _add_settings_flags

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _links() -> list[tuple[Path, str]]:
    return [
        (page, target)
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_pages_link_to_each_other() -> None:
    assert len(PAGES) >= 10 and len(_links()) >= 20


@pytest.mark.parametrize(("page", "target"), _links(), ids=lambda x: str(x)[-40:])
def test_every_relative_link_resolves(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading #{anchor}"


def test_every_serve_flag_is_in_the_configuration_page() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    serve = argparse.ArgumentParser()
    _add_settings_flags(serve)
    flags = [o for a in serve._actions for o in a.option_strings if o.startswith("--")]
    assert len(flags) > 30
    missing = [f for f in flags if f != "--help" and not re.search(rf"{f}(?![\w-])", text)]
    assert not missing, f"`trainctl serve` flags missing from docs/configuration.md: {missing}"
