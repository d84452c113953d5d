"""Hostile and mistyped config files: every one is refused with one clear line per problem, quickly, and no other
exception escapes (property-based with hypothesis for random and mutated YAML)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import time
import tracemalloc
from dataclasses import replace

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deviceplugin import limits
from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import load_config, parse_config, parse_config_bytes, parse_config_text
from deviceplugin.config.paths import mps_root_problem, path_problem, pool_dir
from deviceplugin.config.types import Config, ConfigError
from deviceplugin.model.node import NodeInfo
from deviceplugin.mps.paths import MpsPaths
from deviceplugin.plugin.wire import EncodedDeviceList

from .conftest import EXAMPLES, GPU_CLI, node

H100 = node("8xH100-80GB")
A100_MIG = node("8xA100-80GB-mig")
EXAMPLE_TEXTS = [p.read_text() for p in sorted((EXAMPLES / "config").glob("*.yaml"))]
# Our composer refuses a 33rd level; libyaml's scanner, looking ahead for keys, may refuse a deep flow collection first.
DEEP = "nested deeper than 32 levels|not valid YAML: while increasing flow level exceeded maximum nesting depth"
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def pools(*items, **top):
    return {"version": "v1", "pools": list(items), **top}


def refusal(data=None, text=None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "cfg.yaml") if text is not None else parse_config(data, "cfg.yaml")
    return err.value


def assert_clear(err: ConfigError) -> None:
    """Every problem is one bounded line `where: reason`."""
    assert err.problems
    for problem in err.problems:
        where, sep, reason = problem.partition(": ")
        assert sep and where.strip() and reason.strip(), problem
        assert "\n" not in problem and len(problem) < 1000, problem
    assert len(str(err).splitlines()) <= limits.MAX_REPORTED_PROBLEMS + 2


def cpu_seconds(fn) -> float:
    """CPU time of `fn` alone: earlier tests' garbage is collected first, not during the measurement."""
    gc.collect()
    started = time.process_time()
    fn()
    return time.process_time() - started


# --- the file ----------------------------------------------------------------------------------


def test_file_problems_name_the_real_cause(tmp_path):
    def cause(path) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert_clear(err.value)
        return str(err.value)

    assert "file: cannot read: no such file (deleted, or not mounted)" in cause(tmp_path / "missing.yaml")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert "file: cannot read: symlink loop (too many levels of symbolic links)" in cause(tmp_path / "a")
    assert "file: cannot read: is a directory" in cause(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    assert "file: is not a regular file" in cause(tmp_path / "fifo")  # and does not wait for a writer
    big = tmp_path / "big.yaml"
    big.write_text("version: v1\n" + "#" * limits.MAX_CONFIG_BYTES)
    assert f"over the limit of {limits.MAX_CONFIG_BYTES} bytes" in cause(big)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"version: v1\ndomain: caf\xe9.example\n")
    assert "file: not UTF-8 text (byte 0xe9 at offset 23)" in cause(latin)


@pytest.mark.parametrize(
    "text, message",
    [
        ("pools: " + "[" * 5000, DEEP),
        ("pools: " + "{a: " * 5000, DEEP),
        ("pools:\n" + "".join("  " * i + "- \n" for i in range(200)), DEEP),
        ("pools: [" + ",".join(["0"] * 20_000) + "]", f"more than {limits.MAX_YAML_NODES} YAML nodes"),
        ("replicas: " + "9" * 5000, r"a value cannot be read: Exceeds the limit \(4300 digits\)"),
        ("version: 2001-02-30", "a value cannot be read: day is out of range for month"),
        (
            "version: [v1\n",
            r"line 2, column 1: not valid YAML: while parsing a flow sequence (did not find )?expected ',' or '\]'",
        ),
        ("a: 1\n---\nb: 2\n", "not valid YAML: expected a single document"),
        ("? [a]\n: 1\n", "not valid YAML: while constructing a mapping found unhashable key"),
    ],
)
def test_hostile_yaml_is_refused_quickly(text, message):
    seconds = cpu_seconds(lambda: refusal(text=text))
    err = refusal(text=text)
    assert re.search(message, str(err)), str(err)
    assert_clear(err)
    assert seconds < 0.5


def test_merge_key_bomb_is_refused_in_constant_memory():
    # Each level merges the previous one ten times: 10**6 entries from a 700-byte file if the copies are not counted.
    lines = ["a0: &a0 {" + ", ".join(f"k{i}: 0" for i in range(10)) + "}"]
    for level in range(1, 7):
        lines.append(f"a{level}: &a{level} {{<<: [{', '.join([f'*a{level - 1}'] * 10)}]}}")
    tracemalloc.start()
    try:
        seconds = cpu_seconds(lambda: refusal(text="\n".join(lines)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.5 and peak < 30 * 2**20
    # Merged entries count as nodes: ten copies of a 1,000-key mapping are refused before they are made.
    big = "{" + ", ".join(f"k{i}: 0" for i in range(1000)) + "}"
    err = refusal(text=f"version: v1\nx: &big {big}\ny: {{<<: [{', '.join(['*big'] * 10)}]}}\n")
    assert f"more than {limits.MAX_YAML_NODES} YAML nodes (values, lists, mappings and merged keys)" in str(err)


def test_anchors_and_merge_keys_still_work():
    text = (
        "version: v1\ndefaultProfile: a\nprofiles:\n  a:\n"
        "    pools: [&p {name: x, mode: shared, replicas: 3}]\n  b:\n    pools: [{<<: *p, replicas: 5}]\n"
    )
    config = parse_config_text(text)
    assert [p.replicas for p in config.pools("a") + config.pools("b")] == [3, 5]


def test_only_the_first_problems_are_listed():
    err = refusal(pools(*({"name": f"p{i}", "mode": "bogus"} for i in range(50))))
    assert len(err.problems) == 50
    lines = str(err).splitlines()
    assert len(lines) == 1 + limits.MAX_REPORTED_PROBLEMS + 1 and lines[-1].strip() == "... and 30 more problems"


# --- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        (pools({"name": "a", "mode": "shared", "replicas": 100_000}), "pools[0].replicas: must be <= 1024, got 100000"),
        (
            pools({"name": "a", "mode": "shared", "replicas": 10**4000}),
            "pools[0].replicas: must be <= 1024, got 1" + "0" * 39 + "...(4001 chars)",
        ),
        (
            pools({"name": "a", "mode": "shared", "backend": "mps", "replicas": 49}),
            "pools[0].replicas: must be <= 48 for backend mps (an MPS server takes 48 clients per GPU",
        ),
        (
            {
                "version": "v1",
                "pools": [{"name": f"p{i}", "mode": "exclusive", "gpus": {"indexes": [i]}} for i in range(65)],
            },
            "pools: at most 64 pools per profile, got 65",
        ),
        (
            {
                "version": "v1",
                "profiles": {f"p{i}": {"pools": [{"name": "a", "mode": "exclusive"}]} for i in range(65)},
            },
            "profiles: at most 64 profiles, got 65",
        ),
        (
            pools({"name": "a", "mode": "shared", "gpus": {"indexes": list(range(300))}}),
            "pools[0].gpus.indexes: must have at most 256 entries, got 300",
        ),
        (
            pools({"name": "a", "mode": "shared", "gpus": {"indexes": [5000]}}),
            "pools[0].gpus.indexes[0]: must be 0-1023, got 5000",
        ),
        (
            pools({"name": "a", "mode": "shared", "gpus": {"models": ["*" * 300]}}),
            "pools[0].gpus.models[0]: must be at most 256 characters, got 300",
        ),
        (pools({"name": "a", "mode": "shared"}, domain="d" * 300), "domain: must be at most 256 characters, got 300"),
        (
            pools({"name": "a", "mode": "shared", "k" * 10_000: 1}),
            "pools[0]." + "k" * 64 + "...(10000 chars): unknown key",
        ),
        (pools({"name": "a", "mode": "shared", "bad\nkey": 1}), "pools[0].bad\\x0akey: unknown key"),
    ],
)
def test_every_key_has_an_upper_bound(data, message):
    err = refusal(data)
    assert message in str(err)
    assert_clear(err)


def test_huge_replicas_and_tiny_shares_are_refused_in_milliseconds():
    assert (
        cpu_seconds(lambda: refusal(text="version: v1\npools: [{name: a, mode: shared, replicas: 100000000}]\n")) < 0.1
    )
    tiny = parse_config(pools({"name": "a", "mode": "shared", "memoryPerShare": "1Mi"}))
    with pytest.raises(
        ConfigError,
        match=r"pools\[0\].memoryPerShare: 1 MiB makes 81559 shares of GPU 0 .* over the limit of 1024 shares",
    ):
        build_resources(tiny, H100)
    assert cpu_seconds(lambda: pytest.raises(ConfigError, build_resources, tiny, H100)) < 0.1
    mps = parse_config(pools({"name": "a", "mode": "shared", "backend": "mps", "memoryPerShare": "1Gi"}))
    with pytest.raises(
        ConfigError,
        match=r"1024 MiB makes 79 shares .* over the limit of 48 shares per GPU or MIG instance \(an MPS server",
    ):
        build_resources(mps, H100)


def test_device_count_is_computed_not_built():
    """64 GPUs x 1024 shares passes every key bound; the ListAndWatch budget refuses it without building 65,536
    devices."""
    big = NodeInfo(
        gpus=tuple(replace(H100.gpus[0], index=i, uuid=f"{H100.gpus[0].uuid[:-3]}{i:03d}") for i in range(64))
    )
    config = parse_config(pools({"name": "a", "mode": "shared", "replicas": 1024}))
    tracemalloc.start()
    try:
        seconds = cpu_seconds(lambda: pytest.raises(ConfigError, build_resources, config, big))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 0.1 and peak < 2**20


@pytest.mark.parametrize(
    "node_info, pool",
    [
        (H100, {"name": "a", "mode": "shared", "replicas": 777}),
        (H100, {"name": "a", "mode": "shared", "memoryPerShare": "100Mi"}),
        (H100, {"name": "a", "mode": "exclusive"}),
        (A100_MIG, {"name": "a", "mode": "shared", "replicas": 9}),
        (A100_MIG, {"name": "a", "mode": "mig", "strategy": "mixed"}),
    ],
)
def test_computed_size_is_the_real_worst_case_size(node_info, pool):
    """The budget admits a list exactly as large as its all-Unhealthy message, and refuses it one byte below."""
    config = parse_config(pools(pool))
    for resource in build_resources(config, node_info):
        size = EncodedDeviceList(resource).response(all_unhealthy=True).ByteSize()
        single = replace(config, profiles={"default": (replace(resource.pool),)})
        sizes = {
            r.name: EncodedDeviceList(r).response(all_unhealthy=True).ByteSize()
            for r in build_resources(single, node_info)
        }
        assert sizes[resource.name] == size
        assert build_resources(single, node_info, budget_bytes=max(sizes.values()))
        if len(sizes) == 1:
            with pytest.raises(ConfigError, match="over the"):
                build_resources(single, node_info, budget_bytes=size - 1)


# --- paths -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, problem",
    [
        ("/run/nvidia/driver", None),
        ("/", None),
        ("run/nvidia", "must be an absolute path, got 'run/nvidia'"),
        ("/run/../etc", "must not contain '..', got '/run/../etc'"),
        (
            "/run//nvidia",
            "must be normalised (no '//', '/./' or trailing '/'): write '/run/nvidia', got '/run//nvidia'",
        ),
        ("//run", "must be normalised"),
        ("/run/./nvidia", "must be normalised"),
        ("/run/nvidia/", "must be normalised"),
        ("/run/\0x", "must not contain a NUL character"),
    ],
)
def test_path_rules(path, problem):
    assert path_problem(path) == problem or (problem and problem in path_problem(path))
    if problem:
        assert f"deviceRoot: {problem}" in str(refusal(pools({"name": "a", "mode": "shared"}, deviceRoot=path)))


@pytest.mark.parametrize(
    "root, problem",
    [
        ("/run/gpu-share/mps", None),
        ("/var/lib/gpu-share/mps", None),
        ("/", "must not be /: /<pool>/shm is mounted into tenant pods"),
        ("/dev", "must not be /dev:"),
        ("/run", "must not be /run:"),
        ("/var/lib", "must not be /var/lib:"),
        ("/dev/shm", "must not be inside /dev:"),
        ("/etc/gpu-share", "must not be inside /etc:"),
        ("/var/lib/kubelet/device-plugins", "must not be inside /var/lib/kubelet:"),
        ("/run/gpu-share/../..", "must not contain '..'"),
        ("relative/mps", "must be an absolute path"),
    ],
)
def test_mps_root_rules(root, problem):
    if problem is None:
        assert mps_root_problem(root) is None
        assert (
            parse_config(pools({"name": "a", "mode": "shared", "backend": "mps", "replicas": 2}, mpsRoot=root)).mps_root
            == root
        )
    else:
        assert problem in mps_root_problem(root)
        assert f"mpsRoot: {problem}" in str(refusal(pools({"name": "a", "mode": "shared"}, mpsRoot=root)))


@pytest.mark.parametrize("name", ["dev/../..", "..", "a/b", ".", "A", "-a", "a" * 41, ""])
def test_pool_names_cannot_leave_the_mps_root(name):
    with pytest.raises(ValueError, match="pool name must be 1-40 characters of"):
        pool_dir("/run/gpu-share/mps", name)
    with pytest.raises(ValueError):
        MpsPaths.of("/run/gpu-share/mps", name)
    if name:
        assert "pools[0].name: must be 1-40 characters of [a-z0-9-]" in str(
            refusal(pools({"name": name, "mode": "shared"}))
        )
    assert str(MpsPaths.of("/run/gpu-share/mps", "dev").shm) == "/run/gpu-share/mps/dev/shm"


# --- property-based: nothing but ConfigError, always clear, always quick ---------------------------

KEYS = [
    "version",
    "domain",
    "pools",
    "profiles",
    "defaultProfile",
    "mpsRoot",
    "deviceRoot",
    "memoryWatchdog",
    "name",
    "mode",
    "replicas",
    "memoryPerShare",
    "backend",
    "mpsLimits",
    "gpus",
    "indexes",
    "uuids",
    "models",
    "resource",
    "strategy",
    "<<",
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**18, max_value=10**80)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(
        ["v1", "shared", "mps", "mig", "exclusive", "timeSlicing", "1Gi", "1Mi", "0Ki", "/", "..", "/etc", "*"]
    )
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=25,
)
BASE = {
    "version": "v1",
    "mpsRoot": "/run/gpu-share/mps",
    "profiles": {
        "a": {
            "pools": [
                {"name": "s", "mode": "shared", "replicas": 4, "gpus": {"indexes": [0, 1]}},
                {"name": "m", "mode": "mig"},
            ]
        },
        "b": {"pools": [{"name": "p", "mode": "shared", "backend": "mps", "memoryPerShare": "8Gi"}]},
    },
}


def outcome(text: str) -> Config | None:
    """Parse, and build on two nodes; None when refused (checked to be clear). Anything else fails the test."""
    seconds = time.process_time()
    try:
        config = parse_config_text(text, "fuzz.yaml")
        for name in config.profiles:
            for target in (H100, A100_MIG):
                try:
                    build_resources(config, target, name)
                except ConfigError as err:
                    assert_clear(err)
    except ConfigError as err:
        assert_clear(err)
        config = None
    assert time.process_time() - seconds < 1.0
    return config


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    outcome(text)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    try:
        parse_config_bytes(data, "fuzz.yaml")
    except ConfigError as err:
        assert_clear(err)


@st.composite
def mutated(draw) -> object:
    """BASE with one to three values replaced, keys added or removed anywhere in the tree."""
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    for _ in range(draw(st.integers(1, 3))):
        parent, key = None, None
        current = doc
        while isinstance(current, (dict, list)) and current and draw(st.booleans()):
            parent = current
            key = draw(st.sampled_from(sorted(current, key=str) if isinstance(current, dict) else range(len(current))))
            current = current[key]
        action = draw(st.sampled_from(["replace", "add", "delete"]))
        if parent is None:
            if action == "replace":
                doc = draw(VALUES)
            elif isinstance(doc, dict):
                doc[draw(st.sampled_from(KEYS))] = draw(VALUES)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(current, dict):
            current[draw(st.sampled_from(KEYS) | st.text(max_size=8))] = draw(VALUES)
        else:
            parent[key] = draw(VALUES)
    return doc


@FUZZ
@given(mutated())
def test_mutated_documents(doc):
    outcome(yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(st.sampled_from(EXAMPLE_TEXTS), st.data())
def test_mutated_text(text, data):
    """Example configs with characters inserted, deleted or replaced: YAML syntax, indentation, anchors, unicode."""
    alphabet = st.sampled_from(
        list("[]{}:-&*!|>'\"%@`#,? \n\t<") + ["\u00e9", "\u202e", "\U0001f600", "\x00", "9" * 30, "&a ", "*a", "<<: "]
    )
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(text)))
        how = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = data.draw(alphabet)
        text = text[:at] + (piece if how != "delete" else "") + text[at + (how != "insert") :]
    outcome(text)


@settings(
    FUZZ, max_examples=30
)  # a deep flow collection costs up to 0.25 s: YAML looks 1024 characters ahead for a key
@given(
    st.integers(1, 3000),
    st.sampled_from(["[", "{a: ", "- ", "&x [", "!!seq ["]),
    st.sampled_from(["pools: ", "", "profiles:\n  p:\n    pools: "]),
)
def test_deep_nesting(depth, opener, prefix):
    outcome("version: v1\n" + prefix + opener * depth)


# --- the commands: one line, never a traceback ---------------------------------------------------


@pytest.mark.parametrize(
    "command, text, message",
    [
        (["config", "check"], "pools: " + "{a: " * 5000, "line 1, column 129: nested deeper than 32 levels"),
        (
            ["config", "check", "--node", str(EXAMPLES / "nodes" / "8xH100-80GB.yaml")],
            "version: v1\npools: [{name: a, mode: shared, memoryPerShare: 1Mi}]\n",
            "pools[0].memoryPerShare: 1 MiB makes 81559 shares of GPU 0",
        ),
        (
            ["run", "--node", str(EXAMPLES / "nodes" / "2xT4.yaml")],
            "version: v1\npools: [{name: a, mode: shared, replicas: 100000}]\n",
            "pools[0].replicas: must be <= 1024, got 100000",
        ),
        (
            ["run", "--node", str(EXAMPLES / "nodes" / "2xT4.yaml")],
            "version: v1\nmpsRoot: /\npools: [{name: dev, mode: shared}]\n",
            "mpsRoot: must not be /: /<pool>/shm is mounted into tenant pods",
        ),
    ],
    ids=["check-nested", "check-on-node", "run-replicas", "run-mps-root"],
)
def test_commands_print_one_clear_line(tmp_path, command, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    args = (
        [*command[:2], str(path), *command[2:]]
        if command[0] == "config"
        else [*command, "--config", str(path), "--plugin-dir", str(tmp_path)]
    )
    proc = subprocess.run([*GPU_CLI, *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == f"gpu-share: error: {path}: {message}" + proc.stderr.split(message, 1)[1]
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("key", ["", "   "])
def test_a_blank_key_is_named_quoted(key):
    err = refusal({"version": "v1", key: 1, "pools": [{"name": "a", "mode": "shared"}]})
    assert_clear(err)
    assert any(p.startswith(repr(key) + ": unknown key") for p in err.problems), err.problems
