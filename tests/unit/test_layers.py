"""The package's imports follow a declared DAG (docs/architecture.md#layers): one core, and over it the two node
front ends, `plugin/` (the device-plugin API) and `dra/` (the DRA driver), siblings that never import each other;
the extender, `runtime/`, `sim/` and `cli/` above. A unit may import its own modules and every unit it builds on,
directly or through others.

Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are not counted; imports inside
functions (lazy ones) are.
"""

from __future__ import annotations

import ast
import re
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deviceplugin"

# Units with several members; every other unit is one package (or top-level module) of its own name.
MEMBERS: dict[str, set[str]] = {
    "leaf": {"__init__", "defaults", "limits", "logs", "errors", "loop", "signals", "api", "aioloop", "atomicfile"},
    "data": {"model", "config"},  # model.devices holds a PoolConfig, config.types a Gpu: they may import each other
}
# unit -> the units it builds on directly
DAG: dict[str, set[str]] = {
    "leaf": set(),
    "data": {"leaf"},
    "discovery": {"data"},
    "mps": {"data"},
    "cluster": {"data"},
    "alloc": {"mps", "cluster"},
    "state": {"alloc"},
    "health": {"state", "discovery"},
    "kube": {"alloc"},
    "agent": {"state", "kube", "discovery"},
    "obs": {"state"},
    "plugin": {"health", "agent", "obs"},
    "dra": {"health", "agent", "obs"},
    "extender": {"kube"},
    "runtime": {"plugin", "dra"},
    "sim": {"runtime", "extender"},
    "cli": {"sim"},
}
CORE = {"leaf", "data", "discovery", "mps", "cluster", "alloc", "state", "health", "kube", "agent", "obs"}
FRONT_ENDS = ("plugin", "dra")
UNIT = {member: unit for unit, members in MEMBERS.items() for member in members} | {u: u for u in DAG}


def below(unit: str) -> set[str]:
    """Every unit `unit` builds on, directly or through others."""
    found: set[str] = set()
    todo = list(DAG[unit])
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(DAG[name])
    return found


def _unit(module: list[str]) -> str:
    """The unit of a module path under deviceplugin (`["plugin", "server"]` -> `plugin`, `["logs"]` -> `leaf`)."""
    name = module[0] if module else "__init__"
    return UNIT["__init__" if name == "__version__" else name]


def _runtime_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import outside `if TYPE_CHECKING:` blocks."""
    found: list[ast.ImportFrom | ast.Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(path: Path, node: ast.ImportFrom | ast.Import) -> list[list[str]]:
    """The deviceplugin modules an import names, as paths under the package."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[1:] for alias in node.names if alias.name.split(".")[0] == "deviceplugin"]
    if node.level:
        package = list(path.relative_to(PACKAGE).parts[:-1])
        base = package[: len(package) - (node.level - 1)]
        module = base + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == "deviceplugin":
        module = node.module.split(".")[1:]
    else:
        return []
    if module:
        return [module]
    return [[alias.name] for alias in node.names]  # from deviceplugin import x


def _may_import(own: str, target: str) -> bool:
    return target == own or target in below(own)


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "api" in path.relative_to(PACKAGE).parts:
            continue
        own = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
        for node in _runtime_imports(ast.parse(path.read_text())):
            for target in _targets(path, node):
                unit = _unit(target)
                if not _may_import(own, unit):
                    where = path.relative_to(PACKAGE)
                    found.append(f"{where}:{node.lineno} imports {'.'.join(target)} ({own} does not build on {unit})")
    return found


def test_every_package_is_in_a_unit_and_the_graph_is_a_dag() -> None:
    names = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in PACKAGE.rglob("*.py")}
    assert names - set(UNIT) == set()
    assert set(DAG) == set(UNIT.values()) and all(deps <= set(DAG) for deps in DAG.values())
    TopologicalSorter(DAG).prepare()  # raises CycleError on a cycle


def test_imports_follow_the_dag() -> None:
    assert _violations() == []


def test_the_two_front_ends_are_siblings_over_one_core() -> None:
    plugin, dra = FRONT_ENDS
    assert below(plugin) == below(dra) == CORE
    assert dra not in below(plugin) and plugin not in below(dra)
    assert all(not below(unit) & set(FRONT_ENDS) for unit in CORE)  # nothing in the core reaches a front end
    assert not below("extender") & set(FRONT_ENDS)  # the scheduler side reads the core only


@pytest.mark.parametrize(
    ("path", "source", "allowed"),
    [
        ("alloc/probe.py", "from ..plugin.server import X\n", False),  # up from the core
        ("alloc/probe.py", "from ..model.node import Gpu\n", True),
        ("plugin/probe.py", "from ..dra.devices import X\n", False),  # across, between the front ends
        ("dra/probe.py", "from ..plugin import wire\n", False),
        ("extender/probe.py", "from ..dra.devices import X\n", False),
        ("dra/probe.py", "from ..health.mpsready import X\n", True),
    ],
)
def test_the_check_sees_a_forbidden_import(path: str, source: str, allowed: bool) -> None:
    """The checker itself, on made-up modules."""
    (node,) = _runtime_imports(ast.parse(source))
    (target,) = _targets(PACKAGE / path, node)
    assert _may_import(_unit(path.split("/")[:1]), _unit(target)) is allowed


def _documented() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """docs/architecture.md#layers: the table's unit -> builds on, and the diagram's edges."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("\n## Layers\n") :].split("\n## ", 2)[1]
    table: dict[str, set[str]] = {}
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or "`" not in cells[1]:
            continue
        units = {_unit([n.strip("/").removesuffix(".py")]) for n in re.findall(r"`([^`]+)`", cells[1])}
        assert len(units) == 1, row
        table[units.pop()] = {_unit([n.strip("/").removesuffix(".py")]) for n in re.findall(r"`([^`]+)`", cells[2])}
    diagram = section[section.index("```mermaid") :].split("```", 2)[1]
    node = r"(\w+)(?:\[[^\]]*\])?"  # an id, with or without its [label]
    edges = set(re.findall(rf"^\s*{node} --> {node}\s*$", diagram, re.M))
    return table, edges


def test_the_architecture_doc_shows_this_dag() -> None:
    table, edges = _documented()
    assert table == DAG
    assert edges == {(unit, dep) for unit, deps in DAG.items() for dep in deps}
