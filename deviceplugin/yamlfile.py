"""Reading YAML strictly: a duplicate key is a problem, and every problem names its line.

PyYAML keeps the last of two equal keys silently and names the input `<unicode string>` in its
errors; both hide mistakes in hand-written config and node files.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """The text is not YAML; str() is `line L, column C: reason`."""


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that records duplicate mapping keys instead of keeping the last one silently."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    self.duplicates.append(
                        f"{_where(key_node.start_mark)}: duplicate key {key!r} (first at line {first_line[key]}); YAML would keep only the last"
                    )
                else:
                    first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base constructor reports it
                pass
        return super().construct_mapping(node, deep=deep)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def load_yaml(text: str) -> tuple[Any, list[str]]:
    """The document and one problem per duplicate key; YamlError (with the line) when it is not YAML."""
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data(), loader.duplicates
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        reason = " ".join(part for part in (err.context, err.problem) if part)
        raise YamlError(f"{_where(mark)}: {reason}" if mark else reason) from None
    except yaml.YAMLError as err:
        raise YamlError(str(err)) from None
    finally:
        loader.dispose()
