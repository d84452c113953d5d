"""Reading YAML files strictly and at a bounded cost: the file's size, the nesting depth and the number of nodes are
checked while it is read, so a hostile or mistyped file is refused in milliseconds and constant memory; a duplicate
key is a problem (PyYAML would keep the last one silently); every problem names its line.

PyYAML alone composes the whole node tree first (about 5 us and 400 bytes per node), recurses once per nesting
level (5,000 levels raise RecursionError, not a YAMLError) and lets aliases and merge keys (`<<: [*a, *a, ...]`)
multiply a small file into millions of entries: 346 bytes of nested aliases are 9**9 paths for whatever walks the
tree. So an alias counts as the whole tree it stands for (computed once per node), and an anchor used inside
itself is refused. Every failure here is a `YamlProblem` whose text is one line, `where: reason`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.resolver import Resolver

from ..limits import MAX_CONFIG_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES
from ..logs import safe_text
from .schema import join

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlProblem(ValueError):
    """The file cannot be read or is not acceptable YAML; str() is one line, `where: reason`."""


def read_bounded(path: str | Path, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The file's bytes (symlinks followed), or YamlProblem naming the real cause."""
    try:
        # Non-blocking: opening a FIFO must not wait for a writer (a regular file ignores the flag).
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise YamlProblem("file: is not a regular file")
            if info.st_size > max_bytes:
                raise YamlProblem(f"file: is {info.st_size} bytes, over the limit of {max_bytes} bytes")
            data = file.read(max_bytes + 1)
    except OSError as err:
        raise YamlProblem(f"file: cannot read: {_cause(err)}") from None
    if len(data) > max_bytes:  # grew while being read
        raise YamlProblem(f"file: is over the limit of {max_bytes} bytes")
    return data


def _cause(err: OSError) -> str:
    if err.errno == errno.ENOENT:
        return "no such file (deleted, or not mounted)"
    if err.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if err.errno == errno.EISDIR:
        return "is a directory"
    return err.strerror or str(err)


def decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise YamlProblem(f"file: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})") from None


if yaml.__with_libyaml__:
    from yaml.cyaml import CParser  # type: ignore[attr-defined]  # not in the stubs

    class _Events(CParser):
        """libyaml's scanner and parser: about 100 times faster than pure Python, and iterative."""

else:  # pragma: no cover - PyYAML built without libyaml

    class _Events(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)


class BoundedLoader(Composer, _Events, SafeConstructor, Resolver):
    """A safe loader (PyYAML's composer on libyaml's events) that refuses more than MAX_YAML_DEPTH levels or
    MAX_YAML_NODES nodes as soon as it meets them. The composer comes first, so its Python methods, not libyaml's,
    build the nodes."""

    def __init__(self, stream: str) -> None:
        _Events.__init__(self, stream)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> the nodes it stands for, aliases expanded
        self._open: set[str] = set()  # anchors of the nodes being composed (an alias to one is recursive)
        self.duplicates: list[str] = []
        self.lines: dict[str, int] = {}  # key path as parse.py names it (`profiles.a.pools[1].replicas`) -> its line

    def construct_document(self, node: Any) -> Any:
        self._map_lines(node, "")
        return super().construct_document(node)

    def _map_lines(self, node: Any, path: str) -> None:
        """Where each key and list item is, by the path a problem names (schema.join's form)."""
        if isinstance(node, MappingNode):
            for key_node, value in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node.value, str):
                    continue
                child = join(path, key_node.value)
                self.lines.setdefault(child, key_node.start_mark.line + 1)
                self._map_lines(value, child)
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                child = f"{path}[{i}]"
                self.lines.setdefault(child, item.start_mark.line + 1)
                self._map_lines(item, child)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Record duplicate keys (with both lines) instead of keeping the last one silently."""
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    self.duplicates.append(
                        f"{_where(key_node.start_mark)}: duplicate key {safe_text(repr(key), 80)} (first at "
                        f"line {first_line[key]}); YAML would keep only the last"
                    )
                else:
                    first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base constructor reports it
                pass
        return super().construct_mapping(node, deep=deep)

    def _count(self, nodes: int, mark: Any) -> None:
        self._nodes += nodes
        if self._nodes > MAX_YAML_NODES:
            raise YamlProblem(
                f"{_where(mark)}: more than {MAX_YAML_NODES} YAML nodes (values, lists, mappings and merged keys)"
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        mark = event.start_mark  # type: ignore[union-attr]  # the composer only asks while events remain
        if isinstance(event, AliasEvent):
            if event.anchor in self._open:
                raise YamlProblem(
                    f"{_where(mark)}: the anchor {safe_text(str(event.anchor), 40)!r} is used inside itself (a "
                    "recursive alias)"
                )
            if event.anchor in self.anchors:
                self._count(self._expanded(self.anchors[event.anchor], mark), mark)  # an alias is the tree it names
            return super().compose_node(parent, index)
        self._count(1, mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise YamlProblem(f"{_where(mark)}: nested deeper than {MAX_YAML_DEPTH} levels")
        anchor = getattr(event, "anchor", None)
        self._depth += 1
        if anchor is not None:
            self._open.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(anchor)

    def _expanded(self, node: Node, mark: Any) -> int:
        """The nodes `node` stands for with every alias in it expanded, stopping at the bound (memoised per node, so
        linear in the file; recursive only as deep as the tree, which compose_node bounds)."""
        if id(node) in self._sizes:
            return self._sizes[id(node)]
        total = 1
        children: list[Node] = []
        if isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, SequenceNode):
            children = list(node.value)
        for child in children:
            total += self._expanded(child, mark)
            if total > MAX_YAML_NODES:
                raise YamlProblem(f"{_where(mark)}: more than {MAX_YAML_NODES} YAML nodes once aliases are expanded")
        self._sizes[id(node)] = total
        return total

    def flatten_mapping(self, node: MappingNode) -> None:
        """Merge keys copy their sources' entries: count the copies before PyYAML makes them."""
        for key, value in node.value:
            if key.tag != _MERGE_TAG:
                continue
            sources = value.value if isinstance(value, SequenceNode) else [value]
            for source in sources:
                if isinstance(source, MappingNode):
                    self.flatten_mapping(source)
                    self._count(len(source.value), node.start_mark)
        super().flatten_mapping(node)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def load_yaml(text: str) -> tuple[Any, list[str]]:
    """The document in `text` and one problem per duplicate key, or YamlProblem."""
    data, duplicates, _ = load_yaml_lines(text)
    return data, duplicates


def load_yaml_lines(text: str) -> tuple[Any, list[str], dict[str, int]]:
    """load_yaml, and the line of every key path (`profiles.a.pools[1].replicas`), for problems to name it."""
    loader = None
    try:
        loader = BoundedLoader(text)
        return loader.get_single_data(), loader.duplicates, loader.lines
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        reason = " ".join(p for p in (err.context, err.problem) if p)
        raise YamlProblem(f"{_where(mark) if mark else 'file'}: not valid YAML: {safe_text(reason, 200)}") from None
    except yaml.reader.ReaderError as err:
        raise YamlProblem(
            f"file: not valid YAML: character #x{err.character:04x} at offset {err.position}: {err.reason}"
        ) from None
    except yaml.YAMLError as err:
        raise YamlProblem(f"file: not valid YAML: {safe_text(' '.join(str(err).split()), 200)}") from None
    except RecursionError:
        raise YamlProblem(f"file: nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
    except YamlProblem:
        raise
    except ValueError as err:  # a constructor refused a value: an integer of over 4300 digits, a 30 February
        raise YamlProblem(f"file: a value cannot be read: {safe_text(str(err), 200)}") from None
    finally:
        if loader is not None:
            loader.dispose()
