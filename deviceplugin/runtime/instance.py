"""One live instance per plugin directory: an exclusive `flock` on the directory itself (the kubelet never deletes
a directory, only the sockets and files in it), held for the life of the process and released by the kernel when
it ends — however it ends.

A second `gpu-share run` on the same directory (a rolling update with surge, an operator's second run) either stands
by, taking over within one poll interval of the first one ending, or exits with a clear error; it never serves
beside the first, so the node is never left with sockets nobody registers, nor with resources split between two.
`--instance-lock PATH` locks another directory or file instead (the plugin directory's filesystem may refuse `flock`,
as NFS or 9p can).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import StartupError

log = logging.getLogger(__name__)

MAX_LOCKS_BYTES = 1024 * 1024  # /proc/locks has one short line per lock on the host
MAX_CMDLINE_BYTES = 512  # of the holder's command line, in messages
LOCK_FLAG = "--instance-lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP)  # a filesystem that refuses flock (NFS, 9p)


class InstanceLock:
    """The instance lock of a plugin directory: a `flock` on `path` (the directory itself unless `--instance-lock`
    names another directory or a file, created if missing); `try_acquire` never blocks."""

    def __init__(self, plugin_dir: Path, path: Path | None = None) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.path = Path(path) if path else self.plugin_dir
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no other live process holds it; True once held."""
        if self._fd is not None:
            return True
        try:
            if self.path.is_dir():
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            else:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise StartupError(
                f"cannot open the instance lock {self.path}: {err.strerror}; choose another with {LOCK_FLAG} PATH"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            if err.errno in UNSUPPORTED:
                where = self.path if self.path.is_dir() else self.path.parent
                raise StartupError(
                    f"the filesystem of {where} refuses flock ({err.strerror}), so the instance lock {self.path}"
                    " cannot be taken;"
                    f" choose a lock path on a local filesystem with {LOCK_FLAG} PATH (a directory or a file)"
                ) from None
            raise
        self._fd = fd
        return True

    def holder(self) -> int | None:
        """The PID holding the lock, as /proc/locks says (None when it cannot tell: another PID namespace, no /proc)."""
        try:
            info = os.stat(self.path)
            with open("/proc/locks", "rb") as file:
                text = file.read(MAX_LOCKS_BYTES).decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            fields = line.split()  # 1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF
            if (
                len(fields) >= 6
                and fields[1] == "FLOCK"
                and fields[5].rsplit(":", 1)[-1] == str(info.st_ino)
                and fields[4].isdigit()
            ):
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


def command_line(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The command line of `pid`, words joined by spaces and cut at MAX_CMDLINE_BYTES (None when unreadable)."""
    try:
        with open(proc / str(pid) / "cmdline", "rb") as file:
            raw = file.read(MAX_CMDLINE_BYTES + 1)
    except OSError:
        return None
    text = " ".join(word.decode(errors="replace") for word in raw[:MAX_CMDLINE_BYTES].split(b"\0") if word)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return (text + "…" if len(raw) > MAX_CMDLINE_BYTES else text) or None


def conflict_message(lock: InstanceLock) -> str:
    """Who holds the lock: `the process holding <path> (pid N: cmdline) has the instance lock of …`."""
    pid = lock.holder()
    if pid is None:
        who = "pid unknown: in another PID namespace, or no /proc"
    else:
        command = command_line(pid)
        who = f"pid {pid}: {command}" if command else f"pid {pid}"
    return f"the process holding {lock.path} ({who}) has the instance lock of the plugin directory {lock.plugin_dir}"
