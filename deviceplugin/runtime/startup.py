"""Start-up checks of the paths given on the command line: one clear line naming the flag, before anything starts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import defaults
from ..errors import FlagError

_PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"))


def check_plugin_dir(value: str, flag: str = "--plugin-dir") -> None:
    """The kubelet's device-plugin directory: it must exist (the kubelet creates it), be a directory we may write to."""
    path = Path(value)
    if _under_pseudo_filesystem(path):
        raise FlagError(
            flag,
            value,
            "is on a kernel pseudo-filesystem",
            f"give the kubelet's device-plugins directory, default {defaults.PLUGIN_DIR}",
        )
    if not path.exists():
        raise FlagError(
            flag,
            value,
            "does not exist",
            "the kubelet creates it when it starts: is the kubelet running, and is the host path mounted here?",
        )
    if not path.is_dir():
        raise FlagError(flag, value, "is not a directory", "give the kubelet's device-plugins directory")
    if not os.access(path, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(path) else "is not writable by this user"
        raise FlagError(
            flag,
            value,
            why,
            "the plugin creates its sockets there: mount it read-write and run as root (see docs/security.md)",
        )


def check_directory(flag: str, value: str, hint: str) -> None:
    """A directory the plugin reads."""
    path = Path(value)
    if not path.is_dir():
        raise FlagError(flag, value, "does not exist" if not path.exists() else "is not a directory", hint)
    if not os.access(path, os.R_OK | os.X_OK):
        raise FlagError(flag, value, "is not readable by this user", hint)


def check_executable(flag: str, value: str, hint: str = "") -> None:
    if shutil.which(value) is None:
        raise FlagError(flag, value, "is not an executable file (nor one on PATH)", hint)


def _under_pseudo_filesystem(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in _PSEUDO_FILESYSTEMS)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
