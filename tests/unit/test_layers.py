"""The floors of the house: every package of `clawr1` is a room on one floor, and an import runs only
down, to a lower floor, or stays in its room; no two modules import each other, through any number
of steps. Every import counts: at the top of a module, inside a function, under `TYPE_CHECKING`.

A new package fails here until it is given a floor; an import that climbs back up, or closes a
circle, fails with its file and line. The wire formats (`gateway/wire/`) plug into the one pipeline:
the rest of the gateway never imports them, but for the app that assembles them and the front's
session match.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TOP = "clawr1"

# Lowest first. `clawr1` itself (its version) shares the ground floor with `core`.
FLOORS: list[tuple[str, ...]] = [
    ("clawr1", "core"),  # the data model and the configuration every room shares
    ("datapool", "engine", "envs"),  # storage, inference, the agents' task environments
    ("reward", "trainer", "flows"),  # the judge, the learner, the agent flows
    ("quality",),  # the quality measure (the engine's replies, the reward's embedder)
    ("guard",),  # the version guard (probes scored by the quality measure)
    ("gateway", "cluster", "demo"),  # the front door, the Ray roles, the demo (a client)
    ("entrypoints",),  # the processes: serve, up (here or on Ray), train
    ("cli",),  # the `clawr1` command
]
# Inside the gateway: the only modules outside `gateway/wire/` that may import a wire format.
WIRE_USERS = {"clawr1.gateway.app", "clawr1.gateway.internal"}


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # the module it names (a package for a name its `__init__` defines)
    where: str  # file:line


def module_files(src: Path, top: str = TOP) -> dict[str, Path]:
    found = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(src: Path, top: str = TOP) -> list[Import]:
    """Every import of a module of `top` by another, wherever in the file it is."""
    files = module_files(src, top)

    def resolve(name: str) -> str | None:  # the longest prefix that is a module
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name == top or name.startswith(top + ".") else None
                if target is not None and target != module:
                    found.append(Import(module, target, f"{path.relative_to(src.parent)}:{node.lineno}"))
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def back_arrows(found: list[Import], floors: list[tuple[str, ...]]) -> list[str]:
    floor = {name: i for i, names in enumerate(floors) for name in names}
    bad = []
    for imp in found:
        a, b = room(imp.importer), room(imp.imported)
        if a != b and floor[b] >= floor[a]:
            bad.append(f"{imp.where}: {imp.importer} (floor {floor[a]}) imports {imp.imported} (floor {floor[b]})")
    return bad


def circles(found: list[Import]) -> list[list[str]]:
    """The import circles between modules (Tarjan's strongly connected components). A package's
    `__init__` importing its own modules is the room holding its furniture, not an arrow."""
    edges: dict[str, set[str]] = {}
    for imp in found:
        if not imp.imported.startswith(imp.importer + "."):
            edges.setdefault(imp.importer, set()).add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@functools.cache
def house() -> list[Import]:
    return imports(SRC)


def test_every_package_has_one_floor():
    rooms = {room(m) for m in module_files(SRC)}
    placed = [name for names in FLOORS for name in names]
    assert len(placed) == len(set(placed)), "a room on two floors"
    assert rooms == set(placed), f"without a floor: {sorted(rooms - set(placed))}; gone: {sorted(set(placed) - rooms)}"


def test_imports_run_only_down_the_floors():
    found = house()
    assert len(found) > 500  # the parse saw the code base (function-level imports included)
    assert back_arrows(found, FLOORS) == []


def test_no_import_circle():
    assert circles(house()) == []


def test_the_wire_formats_plug_into_the_pipeline_and_nothing_else_reaches_them():
    reach = sorted({f"{imp.where}: {imp.importer}" for imp in house()
                    if imp.imported.startswith("clawr1.gateway.wire.")
                    and not imp.importer.startswith("clawr1.gateway.wire")
                    and imp.importer not in WIRE_USERS})
    assert reach == []


def test_the_checks_catch_a_back_arrow_and_a_circle(tmp_path):
    """The checks themselves, on a made-up house: a back arrow (core imports the gateway, inside a
    function) and a circle (two gateway modules, one under TYPE_CHECKING) are each found."""
    pkg = tmp_path / "src" / TOP
    for name, text in {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/types.py": "def f():\n    from clawr1.gateway.service import Gateway\n",
        "gateway/__init__.py": "",
        "gateway/service.py": "from clawr1.gateway.metrics import GatewayMetrics\n",
        "gateway/metrics.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from clawr1.gateway.service import Gateway\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = imports(tmp_path / "src")
    assert back_arrows(found, [("clawr1", "core"), ("gateway",)]) == [
        "src/clawr1/core/types.py:2: clawr1.core.types (floor 0) imports clawr1.gateway.service (floor 1)"]
    assert circles(found) == [["clawr1.gateway.metrics", "clawr1.gateway.service"]]
