"""Atomic file replacement: a reader, or a process that crashes mid-write, sees the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path

TMP = ".tmp"  # the suffix of a temporary file a crashed writer may leave behind


def atomic_write(path: Path, content: bytes, durable: bool = True) -> None:
    """Write `content` to `path` so that a reader, or a process that crashes, sees the old file or the new one,
    never a mix; with `durable` the content is fsynced before the rename. The temporary file's name starts with a
    dot, which CDI runtimes, the kubelet's plugin watcher and the checkpoint skip."""
    tmp = path.with_name(f".{path.name}{TMP}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:  # a full disk, an I/O error: leave no temporary file behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
