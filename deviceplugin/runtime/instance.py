"""One live instance per plugin directory: an exclusive `flock` on the directory itself (the kubelet never deletes
a directory, only the sockets and files in it), held for the life of the process and released by the kernel when
it ends — however it ends.

A second `gpu-share run` on the same directory (a rolling update with surge, an operator's second run) either stands
by, taking over within one poll interval of the first one ending, or exits with a clear error; it never serves
beside the first, so the node is never left with sockets nobody registers, nor with resources split between two.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MAX_LOCKS_BYTES = 1024 * 1024  # /proc/locks has one short line per lock on the host


class InstanceLock:
    """The plugin directory's instance lock; `try_acquire` never blocks."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = Path(plugin_dir)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no other live process holds it; True once held."""
        if self._fd is not None:
            return True
        fd = os.open(self.plugin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._fd = fd
        return True

    def holder(self) -> int | None:
        """The PID holding the lock, as /proc/locks says (None when it cannot tell: another PID namespace, no /proc)."""
        try:
            info = os.stat(self.plugin_dir)
            with open("/proc/locks", "rb") as file:
                text = file.read(MAX_LOCKS_BYTES).decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            fields = line.split()  # 1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(info.st_ino) and fields[4].isdigit():
                return int(fields[4])
        return None

    def wait(self, stop: Callable[[float], bool], interval: float) -> bool:
        """Stand by until the lock is ours (True) or `stop(interval)` says the process is stopping (False)."""
        while not self.try_acquire():
            if stop(interval):
                return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def conflict_message(lock: InstanceLock) -> str:
    pid = lock.holder()
    who = f"another gpu-share instance (pid {pid})" if pid else "another gpu-share instance"
    return f"{who} serves the plugin directory {lock.plugin_dir}"
