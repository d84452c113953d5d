"""Small helpers for validating YAML documents with errors that name the key path."""

from __future__ import annotations

import difflib
from typing import Any

from ..limits import MAX_STRING_LENGTH
from ..logs import safe_text

_TYPE_NAMES = {int: "an integer", str: "a string", list: "a list", dict: "a mapping", bool: "a boolean"}


class SchemaError(ValueError):
    """A document key is missing, unknown or has a bad value; str() is `path: reason`."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def join(path: str, key: object) -> str:
    """`path.key`; a key from the document is escaped and cut short, so a path stays one short line whatever the file
    holds."""
    shown = safe_text(str(key), 64)
    if not shown.strip():  # an empty or blank key is quoted, or the message would name nothing
        shown = repr(shown)
    return f"{path}.{shown}" if path else shown


def type_ok(value: Any, expected: type) -> bool:
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


class Fields:
    """A mapping at `path` whose keys must be among `spec` (key -> expected type).

    With a `problems` list, bad keys and values are recorded there (get() then returns the default)
    instead of raised, so one pass reports every problem.
    """

    def __init__(self, data: Any, path: str, spec: dict[str, type], problems: list[str] | None = None) -> None:
        if not isinstance(data, dict):
            raise SchemaError(path or "(top level)", f"must be a mapping, got {_describe(data)}")
        self.data = data
        self.path = path
        self.spec = spec
        self.problems = problems
        for key in data:
            if key not in spec:
                self._fail(SchemaError(join(path, key), unknown_key_reason(str(key)[:MAX_STRING_LENGTH], spec)))

    def _fail(self, error: SchemaError) -> None:
        if self.problems is None:
            raise error
        self.problems.append(str(error))

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        if key not in self.data:
            if required:
                self._fail(SchemaError(join(self.path, key), "is required"))
            return default
        value = self.data[key]
        expected = self.spec[key]
        if not type_ok(value, expected):
            self._fail(
                SchemaError(
                    join(self.path, key),
                    f"must be {_TYPE_NAMES.get(expected, expected.__name__)}, got {_describe(value)}",
                )
            )
            return default
        problem = _length_problem(value)
        if problem:
            self._fail(SchemaError(join(self.path, key), problem))
            return default
        return value

    def check(self, condition: bool, key: str, reason: str) -> None:
        if not condition:
            self._fail(SchemaError(join(self.path, key), reason))


def unknown_key_reason(key: str, known: dict[str, type]) -> str:
    """`unknown key`, with the nearest known key (case and small typos forgiven) and the full list."""
    by_lower = {k.lower(): k for k in known}
    near = by_lower.get(key.lower()) or next(iter(difflib.get_close_matches(key, known, n=1, cutoff=0.75)), None)
    hint = f"; did you mean {near!r}?" if near else ""
    return f"unknown key{hint} (known keys: {', '.join(sorted(known))})"


def list_of(items: list[Any], path: str, expected: type, max_items: int | None = None) -> list[Any]:
    """Check the list's length and that every element has the expected type."""
    if max_items is not None and len(items) > max_items:
        raise SchemaError(path, f"must have at most {max_items} entries, got {len(items)}")
    for i, item in enumerate(items):
        if not type_ok(item, expected):
            raise SchemaError(
                f"{path}[{i}]", f"must be {_TYPE_NAMES.get(expected, expected.__name__)}, got {_describe(item)}"
            )
        problem = _length_problem(item)
        if problem:
            raise SchemaError(f"{path}[{i}]", problem)
    return items


def _length_problem(value: Any) -> str | None:
    if isinstance(value, str) and len(value) > MAX_STRING_LENGTH:
        return f"must be at most {MAX_STRING_LENGTH} characters, got {len(value)}"
    return None


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, (int, float)):
        return f"number {safe_text(str(value), 40)}"
    if isinstance(value, str):
        return f"string {safe_text(repr(value), 80)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
