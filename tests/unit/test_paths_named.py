"""Words that stay true: every repository path the docs and the code's docstrings and comments
name in backticks exists, and a ``path.py:Name`` names something that file defines. A file
renamed without its mentions fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("api", "bench", "clients", "deploy", "docs", "examples", "helm", "scripts", "service",
       "tests", "workers", ".ci")  # fmt: skip
"""The repository's top-level folders: a backticked token starting with one is a path."""
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[^`\s:]*)(?::(\w+))?`")
PACKAGE = {"trainctl/" + t: t for t in ("api", "clients", "service", "workers")}
"""Installed ``trainctl/<x>`` is the checkout's ``<x>``."""


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in ("api", "bench", "clients", "examples", "scripts", "service", "tests", "workers"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


def _defines(path: Path, name: str) -> bool:
    text = path.read_text()
    return bool(
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]", text, re.M)
    )


def test_every_named_path_exists() -> None:
    missing = []
    for src in _sources():
        for lineno, line in enumerate(src.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                target, name = m.group(1).rstrip(".,;)"), m.group(2)
                if any(ch in target for ch in "*{}<>$") or target.endswith("..."):
                    continue  # a pattern, not a path
                path = ROOT / target
                where = f"{src.relative_to(ROOT)}:{lineno}"
                if not path.exists():
                    missing.append(f"{where}: `{target}` does not exist")
                elif name and path.suffix == ".py" and not _defines(path, name):
                    missing.append(f"{where}: `{target}` defines no {name}")
    assert not missing, "\n".join(missing)
