"""Confined paths: the config's path keys and the pool names joined into them.

`mpsRoot/<pool>/shm` is bind-mounted into tenant pods, so a path key that escapes (`..`), is not what it looks like
(`//`, `/./`, a trailing `/`) or lands in a system directory (`mpsRoot: /` with a pool named `dev` is the host's
`/dev/shm`) would hand the host to tenants. Every path key must be absolute and already normalised; pool names
are a strict pattern with no `.` or `/`.
"""

from __future__ import annotations

import posixpath
import re

from ..limits import MAX_STRING_LENGTH

POOL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
POOL_NAME_RULE = "1-40 characters of [a-z0-9-], starting and ending alphanumeric"

# mpsRoot may be none of these, nor inside the first group.
_SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib/kubelet",
)
_SYSTEM_DIRS = ("/", "/home", "/mnt", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/var/lib", "/var/run")


def path_problem(path: str) -> str | None:
    """Why `path` is not an absolute, normalised path without `..`, or None when it is."""
    if not path.startswith("/"):
        return f"must be an absolute path, got {path!r}"
    if "\0" in path:
        return "must not contain a NUL character"
    if ".." in path.split("/"):
        return f"must not contain '..', got {path!r}"
    if posixpath.normpath(path) != path or path.startswith("//"):
        return f"must be normalised (no '//', '/./' or trailing '/'): write {posixpath.normpath(path)!r}, got {path!r}"
    return None


def mps_root_problem(path: str) -> str | None:
    """path_problem, and mpsRoot must not be `/` or a system directory (its pool directories reach tenant pods)."""
    problem = path_problem(path)
    if problem:
        return problem
    why = (
        f"{posixpath.join(path, '<pool>', 'shm')} is mounted into tenant pods; use a directory of its own "
        "such as /run/gpu-share/mps"
    )
    if path in _SYSTEM_DIRS or path in _SYSTEM_TREES:
        return f"must not be {path}: {why}"
    for tree in _SYSTEM_TREES:
        if path.startswith(tree + "/"):
            return f"must not be inside {tree}: {why}"
    return None


def pool_name_problem(name: str) -> str | None:
    if len(name) > MAX_STRING_LENGTH or not POOL_NAME.match(name):
        return f"must be {POOL_NAME_RULE}, got {name[:MAX_STRING_LENGTH]!r}"
    return None


def pool_dir(root: str, pool: str) -> str:
    """`<root>/<pool>`; ValueError when `pool` is not a pool name (so it can never leave `root`)."""
    problem = pool_name_problem(pool)
    if problem:
        raise ValueError(f"pool name {problem}")
    return posixpath.join(root, pool)
