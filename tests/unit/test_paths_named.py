"""Words that stay true: every repository path the docs and the code's docstrings and comments
name in backticks exists, and a ``path.py:Name`` names something that file defines. A file
renamed without its mentions fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("api", "bench", "clients", "deploy", "docs", "examples", "helm", "local", "scripts",
       "service", "tests", "workers", ".ci")  # fmt: skip
"""The repository's top-level folders: a backticked token starting with one is a path."""
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[^`\s:]*)(?::(\w+))?`")
PACKAGE = {"trainctl/" + t: t for t in ("api", "clients", "local", "service", "workers")}
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


BARE = re.compile(r"(?<![\w/.-])`{1,2}([A-Za-z_]\w*\.py)`{1,2}")
"""A file named without its folder, in backticks."""


def test_a_bare_file_name_in_code_is_a_file_of_the_same_folder() -> None:
    """In the code's docstrings and comments, a bare file name in backticks means the file
    beside the one that names it; any other file is written with its folder."""
    stale = [
        f"{src.relative_to(ROOT)}:{lineno}: ``{m.group(1)}`` is not in {src.parent.name}/"
        for src in _sources()
        if src.suffix == ".py"
        for lineno, line in enumerate(src.read_text().splitlines(), 1)
        for m in BARE.finditer(line)
        if m.group(1) != "__init__.py" and not (src.parent / m.group(1)).exists()
    ]
    assert not stale, "\n".join(stale)


PRODUCT = ("api", "clients", "local", "service", "workers")
CODE_MAP = re.compile(r"^\| `([\w/]+/)` \| `trainctl[\w.]*` \| (.*) \|$", re.M)


def test_every_product_module_is_named_in_the_code_map() -> None:
    """docs/architecture.md's code map names every module of the package, in the row of its
    folder (the deepest row above it): a module added without a line there fails here."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(CODE_MAP.findall(page))
    missing = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or "__pycache__" in rel:
                continue
            if f"`{rel}`" in page:
                continue  # named with its folder (the table of mechanisms)
            folder = max((f for f in rows if rel.startswith(f)), key=len, default=None)
            if folder is None or f"`{path.name}`" not in rows[folder]:
                missing.append(f"{rel} (row {folder})")
    assert not missing, "not in the code map:\n" + "\n".join(missing)
