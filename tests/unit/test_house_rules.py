"""The house's structural rules, read off the source with ``ast``: a class is built from
collaborators, not cut into mixins. No class in ``workers/`` has more than one base defined in
this repository, and no class body declares what it does not own: no ``if TYPE_CHECKING:``
block (stubs of a host's methods) and no annotation-only attribute that neither its
``__init__`` assigns nor a dataclass makes a field of."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "workers"


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    out = []
    for path in sorted(WORKERS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        out += [(path, n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return out


def _local_class_names() -> set[str]:
    return {c.name for _, c in _classes()}


def _is_dataclass_like(cls: ast.ClassDef) -> bool:
    """A dataclass, a Protocol, a NamedTuple or a TypedDict: their annotations are fields."""
    names = {ast.unparse(d).split("(")[0].split(".")[-1] for d in cls.decorator_list}
    bases = {ast.unparse(b).split("[")[0].split(".")[-1] for b in cls.bases}
    return bool(
        names & {"dataclass"}
        or bases & {"Protocol", "NamedTuple", "TypedDict", "BaseModel", "Enum", "IntEnum"}
    )


def _assigned_in_init(cls: ast.ClassDef) -> set[str]:
    init = next(
        (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None
    )
    if init is None:
        return set()
    out = set()
    for node in ast.walk(init):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for el in ast.walk(t):
                if isinstance(el, ast.Attribute) and ast.unparse(el.value) == "self":
                    out.add(el.attr)
    return out


def test_no_class_mixes_in_two_bases_of_this_repository() -> None:
    local = _local_class_names()
    mixed = []
    for path, cls in _classes():
        bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in cls.bases]
        ours = [b for b in bases if b in local]
        if len(ours) > 1:
            mixed.append(f"{path.relative_to(ROOT)}: {cls.name}({', '.join(ours)})")
    assert not mixed, mixed


def test_no_class_declares_what_it_does_not_own() -> None:
    problems = []
    for path, cls in _classes():
        where = f"{path.relative_to(ROOT)}:{cls.lineno} {cls.name}"
        for node in cls.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                problems.append(f"{where}: an `if TYPE_CHECKING:` block in the class body")
        if _is_dataclass_like(cls):
            continue
        owned = _assigned_in_init(cls)
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and node.value is None:
                name = ast.unparse(node.target)
                if name not in owned:
                    problems.append(f"{where}: `{name}` is annotated, never assigned in __init__")
    assert not problems, "\n".join(problems)


def test_every_class_with_state_says_what_it_owns() -> None:
    """The reviewer's gate that replaced the line count: a class that builds state in its
    ``__init__`` says in its docstring what it owns (``Owns ...``), so a second concern shows
    up as a second thing owned. Exceptions are exempt."""
    problems = []
    for path, cls in _classes():
        if any(ast.unparse(b).endswith(("Error", "Exception")) for b in cls.bases):
            continue
        if _assigned_in_init(cls) and not re.search(
            r"\bown(s|ed)?\b", ast.get_docstring(cls) or "", re.I
        ):
            problems.append(f"{path.relative_to(ROOT)}: {cls.name} does not say what it owns")
    assert not problems, "\n".join(problems)


def test_test_modules_have_names_of_their_own() -> None:
    """pytest imports every test directory's modules into one namespace: two helpers named
    alike (an ``engine_cases`` module in two tiers) made one tier import the other's, and failed
    every distributed test in one CI run."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name not in ("conftest.py", "__init__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, clashes


def _test_imports() -> list[tuple[Path, str, list[str]]]:
    """Every import in ``tests/`` of a module that lives in ``tests/``: (importer, module,
    names)."""
    tests = ROOT / "tests"
    local = {p.stem for p in tests.rglob("*.py")} | {"helpers"}
    out = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in local:
                    out.append((path, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out += [(path, a.name, []) for a in node.names if a.name.split(".")[0] in local]
    return out


def test_tests_share_through_helpers_only() -> None:
    """A test module takes what it shares from ``tests/helpers/`` (or from ``*_cases.py``
    beside it, whose functions its rank processes run), never from another test module or a
    conftest, and never a private name: the names another module reached into were renamed
    under it, and a conftest's imports are pytest's, not a module's."""
    problems = []
    for path, module, names in _test_imports():
        where = path.relative_to(ROOT)
        first = module.split(".")[0]
        beside = (path.parent / f"{first}.py").exists() and first.endswith("_cases")
        if first != "helpers" and not beside:
            problems.append(f"{where}: imports {module}")
        problems += [f"{where}: imports the private {module}.{n}" for n in names if n[0] == "_"]
    assert not problems, "\n".join(problems)


DOORS = {
    WORKERS / "control" / "rank_group.py": "the rank workers",
    WORKERS / "sampler" / "pool.py": "the sampler engines",
}


def test_remote_actors_are_called_through_their_one_door() -> None:
    """Only ``RankGroup`` calls a rank worker's method (``.remote(...)``) and only the sampler
    pool calls an engine's: every other module in ``workers/`` goes through their typed
    methods, so a call's deadline, error classification and failure handling live in one
    place. Making an actor class (``ray.remote(Cls)``) is not a call."""
    side_doors = []
    for path in sorted(WORKERS.rglob("*.py")):
        if path in DOORS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "remote"
                and ast.unparse(node.func.value) != "ray"
            ):
                side_doors.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert all(p.exists() for p in DOORS), DOORS
    assert not side_doors, "calls past the door:\n" + "\n".join(side_doors)


def test_the_gateways_door_to_the_controller_is_the_controllers_own_signature() -> None:
    """The gateway reaches the controller actor by method name (``RayController``), typed by
    the ``ControllerAPI`` protocol: every member must be a ``Controller`` method with the same
    parameters and return type, or a renamed or retyped method would fail only at run time.
    (Ray's actor wrapper adds a ``_ray_trace_ctx`` keyword to each method: not ours.)"""
    import inspect

    from trainctl.service.controller_client import ControllerAPI
    from trainctl.workers.control.controller import Controller

    def ours(method: object) -> inspect.Signature:
        sig = inspect.signature(method)  # type: ignore[arg-type]
        return sig.replace(parameters=[p for p in sig.parameters.values()
                                       if p.name != "_ray_trace_ctx"])  # fmt: skip

    members = [n for n, v in vars(ControllerAPI).items() if inspect.iscoroutinefunction(v)]
    assert len(members) >= 17, members
    differ = {
        name: (str(ours(getattr(ControllerAPI, name))), str(ours(getattr(Controller, name, None))))
        for name in members
        if not inspect.iscoroutinefunction(getattr(Controller, name, None))
        or ours(getattr(ControllerAPI, name)) != ours(getattr(Controller, name))
    }
    assert not differ, differ


PRODUCT = ("api", "clients", "local", "service", "workers")
MAX_IGNORES = 20
LONG_MODULE = 450


def _product_modules() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))]


def test_type_ignores_are_few_and_each_says_why() -> None:
    """Product code silences the type checker at most ``MAX_IGNORES`` times, each time for
    named error codes and with its reason after it on the line
    (``# type: ignore[misc]  # megatron-core ships no types``)."""
    ignores, unexplained = [], []
    pragma = re.compile(r"#\s*type:\s*ignore(\[[^\]]+\])?(.*)$")
    for path in _product_modules():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = pragma.search(line)
            if m is None:
                continue
            where = f"{path.relative_to(ROOT)}:{lineno}"
            ignores.append(where)
            if m.group(1) is None or not re.match(r"\s+#\s*\w", m.group(2)):
                unexplained.append(f"{where}: {line.strip()}")
    assert ignores, "the scan found no pragma at all: it reads the wrong files"
    assert len(ignores) <= MAX_IGNORES, "\n".join(ignores)
    assert not unexplained, "say which error and why:\n" + "\n".join(unexplained)


def test_mypy_holds_every_product_folder_to_strict() -> None:
    """The strict override in pyproject.toml covers every product folder: narrowing it would
    let a folder's types rot while CI's mypy run stays green."""
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs") and o.get("warn_return_any")]
    assert len(strict) == 1, strict
    assert sorted(strict[0]["module"]) == sorted(f"{f}.*" for f in PRODUCT)


def test_a_long_module_says_why_it_is_one_concern() -> None:
    """A product module over ``LONG_MODULE`` lines says in its docstring, on a line that starts
    "One concern", why its length is one job and not two."""
    unexplained = []
    for path in _product_modules():
        text = path.read_text()
        if text.count("\n") <= LONG_MODULE:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("One concern") for line in doc.splitlines()):
            unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, "long modules without a reason:\n" + "\n".join(unexplained)
