"""The bounded YAML loader: alias and anchor shapes that multiply a small file are refused before anything walks
them (the 346-byte bomb hung the line map once), and plain anchors still load."""

from __future__ import annotations

import tracemalloc

import pytest

from deviceplugin.config.yamlfile import YamlProblem, load_yaml, load_yaml_lines
from deviceplugin.limits import MAX_YAML_NODES


def _nested(kind: str, width: int = 9, levels: int = 9) -> str:
    """`levels` anchors, each `width` aliases of the one before: width**levels nodes once expanded."""
    lines = ["version: v1"]
    if kind == "list":
        lines.append("l0: &l0 [" + ", ".join(['"x"'] * width) + "]")
        lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    elif kind == "map":
        lines.append("m0: &m0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}")
        lines += [
            f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" for j in range(width)) + "}" for i in range(1, levels)
        ]
    else:  # merge keys of merge keys
        lines.append("m0: &m0 {" + ", ".join(f"k{j}: x" for j in range(width)) + "}")
        lines += [
            f"m{i}: &m{i} {{<<: [*m{i - 1}], " + ", ".join(f"n{j}: *m{i - 1}" for j in range(width)) + "}"
            for i in range(1, levels)
        ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("kind", ["list", "map", "merge"])
def test_nested_aliases_are_refused_before_they_are_expanded(kind):
    text = _nested(kind)
    assert len(text) < 1200
    tracemalloc.start()
    try:
        with pytest.raises(YamlProblem, match=f"more than {MAX_YAML_NODES} YAML nodes"):
            load_yaml_lines(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024  # the tree it stands for (9**9 nodes) is never built or walked


def test_the_346_byte_bomb_names_its_line():
    text = _nested("list")
    with pytest.raises(YamlProblem) as err:
        load_yaml(text)
    assert str(err.value).startswith("line ") and "YAML nodes" in str(err.value)


@pytest.mark.parametrize("text", ["a: &r [*r]\n", "a: &r {b: *r}\n", "a: &r [[[*r]]]\n"])
def test_an_anchor_used_inside_itself_is_refused(text):
    with pytest.raises(YamlProblem, match="recursive alias"):
        load_yaml(text)


def test_an_alias_under_the_bound_loads_and_maps_its_lines():
    data, duplicates, lines = load_yaml_lines(
        "base: &b {mode: shared, replicas: 4}\npools:\n  - *b\n  - <<: *b\n    name: x\n"
    )
    assert data["pools"] == [{"mode": "shared", "replicas": 4}, {"mode": "shared", "replicas": 4, "name": "x"}]
    assert duplicates == [] and lines["pools[1].name"] == 5


def test_many_aliases_of_one_small_anchor_count_each_time():
    width = MAX_YAML_NODES // 3
    with pytest.raises(YamlProblem, match="YAML nodes"):
        load_yaml("a: &a [1, 2]\nb: [" + ", ".join(["*a"] * width) + "]\n")
