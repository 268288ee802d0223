"""The map from folders to ``trainctl.*`` names, and the import graph it gives.

The top-level folders (``api``, ``clients``, ``service``, ``workers``) are the package
``trainctl`` through ``[tool.setuptools] package-dir``. These tests hold that map to the
tree, and the tree's imports to one direction.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
ROOTS = ("trainctl.api", "trainctl.clients", "trainctl.service", "trainctl.workers")


def test_every_package_folder_is_mapped() -> None:
    """Each folder with an ``__init__.py`` under the mapped roots is a listed package with
    its own ``package-dir`` entry (a folder left out would be missing from the wheel)."""
    mapped = SETUPTOOLS["package-dir"]
    folders = {
        ".".join(("trainctl", *p.parent.relative_to(ROOT).parts))
        for top in ("api", "clients", "local", "service", "workers")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert folders == set(mapped) == set(SETUPTOOLS["packages"])
    for name, folder in mapped.items():
        assert name == ".".join(("trainctl", *Path(folder).parts)), (name, folder)


IMPORT_FROM_CHECKOUT = """
import importlib, importlib.abc, importlib.util, sys, tomllib
from pathlib import Path

root = Path(sys.argv[1])
sys.path = [p for p in sys.path if "__editable__" not in p and p not in ("", ".")]
mapped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

class Checkout(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "trainctl":
            return importlib.util.spec_from_loader(name, None, is_package=True)
        if name in mapped:
            init = root / mapped[name] / "__init__.py"
            return importlib.util.spec_from_file_location(name, init)
        parent, _, leaf = name.rpartition(".")
        file = root / mapped.get(parent, "-") / f"{leaf}.py"
        if parent in mapped and file.is_file():
            return importlib.util.spec_from_file_location(name, file)
        return None

sys.meta_path.insert(0, Checkout())
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(root), (name, module.__file__)
print("imported", len(sys.argv) - 2)
"""


def test_each_folder_imports_by_its_trainctl_name_from_the_checkout() -> None:
    """Without the install (its path entries removed), the map in ``pyproject.toml`` alone
    finds every package, and each imports from this checkout."""
    names = sorted(SETUPTOOLS["package-dir"])
    r = subprocess.run(
        [sys.executable, "-c", IMPORT_FROM_CHECKOUT, str(ROOT), *names],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == f"imported {len(names)}"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), smallest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(out, key=len)


def test_no_import_cycles() -> None:
    """No module reaches itself through imports, function-level imports included (a loop
    is two modules that can only be read together)."""
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    assert _cycles(graph) == []


def test_the_engine_imports_nothing_from_its_controller() -> None:
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    for low in ("trainctl.workers.engine", "trainctl.workers.ops", "trainctl.workers.sampler"):
        chains = graph.find_shortest_chains(importer=low, imported="trainctl.workers.control")
        assert not chains, chains
