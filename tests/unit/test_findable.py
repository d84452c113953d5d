"""Every module's test is findable: a file of its own name, or a line in tests/README.md naming where it is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deviceplugin"
README = ROOT / "tests" / "README.md"
SECTION = "## Where each module's test is"
LINE = re.compile(r"^- `(?P<module>[\w/]+\.py)`: (?P<tests>.+)$")


def _modules() -> list[str]:
    """Every module of the package, relative to deviceplugin/ (package markers left out)."""
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )


def _own_test(module: str) -> Path:
    """tests/unit/<package>/test_<module>.py for deviceplugin/<package>/<module>.py."""
    parts = Path(module).parts
    return ROOT / "tests" / "unit" / Path(*parts[:-1], "test_" + parts[-1])


def _listed() -> dict[str, list[str]]:
    """module -> the test files its tests/README.md line names."""
    text = README.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    listed: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = LINE.match(line)
        if match:
            listed[match["module"]] = re.findall(r"`(tests/[^`]+)`", match["tests"])
    return listed


def test_every_module_has_its_own_test_file_or_a_readme_line() -> None:
    listed = _listed()
    lost = [module for module in _modules() if not _own_test(module).exists() and not listed.get(module)]
    assert not lost, f"modules with no tests/unit/<pkg>/test_<module>.py and no tests/README.md line: {lost}"


def test_every_readme_line_names_a_module_and_test_files_that_exist() -> None:
    modules = set(_modules())
    for module, tests in _listed().items():
        assert module in modules, f"tests/README.md names {module}, which is not a module of deviceplugin/"
        missing = [test for test in tests if not (ROOT / test).exists()]
        assert not missing, f"tests/README.md line for {module} names test files that do not exist: {missing}"
