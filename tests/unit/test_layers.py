"""Data flows one way: each package imports only packages of lower layers (docs/architecture.md).

Imports under `if TYPE_CHECKING:` are annotations, not dependencies, and are not counted; imports inside
functions (lazy ones) are.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deviceplugin"

# Lowest first; a package may import its own modules and those of any lower layer.
LAYERS: list[set[str]] = [
    {"__init__", "defaults", "limits", "logs", "errors", "loop", "signals", "api", "aioloop", "atomicfile"},  # leaf modules and generated stubs
    {"model", "config"},  # the data: node, devices, config types (model.devices holds a PoolConfig, config.types a Gpu)
    {"discovery"},
    {"mps", "cluster"},
    {"alloc"},
    {"state"},
    {"plugin", "health"},
    {"kube"},
    {"agent"},
    {"obs"},
    {"dra"},
    {"extender"},
    {"runtime"},
    {"sim"},
    {"cli"},
]
SHARED_LAYERS = {0, 1}  # their members may import each other (leaf modules; model and config)
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}


def _unit(module: list[str]) -> str:
    """The layer unit of a module path under deviceplugin (`["plugin", "server"]` -> `plugin`)."""
    return module[0] if module else "__init__"


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


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "api" in path.relative_to(PACKAGE).parts:
            continue
        own = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
        for node in _runtime_imports(ast.parse(path.read_text())):
            for target in _targets(path, node):
                unit = _unit(target)
                if unit == "__version__":
                    unit = "__init__"
                if unit != own and (RANK[unit] > RANK[own] or (RANK[unit] == RANK[own] and RANK[own] not in SHARED_LAYERS)):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {'.'.join(target)} ({own} may not import {unit})")
    return found


def test_every_package_is_in_a_layer() -> None:
    units = {_unit(list(p.relative_to(PACKAGE).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")}
    assert units - set(RANK) == set()


def test_imports_go_only_to_lower_layers() -> None:
    assert _violations() == []


@pytest.mark.parametrize("source, expected", [("from ..plugin.server import X\n", True), ("from ..model.node import Gpu\n", False)])
def test_the_check_sees_an_upward_import(source: str, expected: bool) -> None:
    """The checker itself: an upward import from alloc is caught, a downward one is not."""
    path = PACKAGE / "alloc" / "probe.py"
    tree = ast.parse(source)
    (node,) = _runtime_imports(tree)
    (target,) = _targets(path, node)
    assert (RANK[_unit(target)] >= RANK["alloc"]) is expected
