"""Prepare and unprepare run one at a time, across threads and across processes (two plugin instances during a
rolling update share the checkpoint): a thread lock, then a write lock on `<plugin dir>/serialize.lock`.

The file lock is an open-file-description lock (`F_OFD_SETLKW`), the kind the Go helper takes where the kernel has
it, so a Python instance replacing a Go one (or the other way round) excludes it; flock where OFD locks are missing.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from pathlib import Path
from types import TracebackType

LOCK_FILE = "serialize.lock"
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)
_FLOCK = "hhqqi4x"  # struct flock on Linux x86-64/arm64: l_type, l_whence, l_start, l_len, l_pid


class SerialLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def __enter__(self) -> SerialLock:
        self._thread_lock.acquire()
        try:
            self._file(fcntl.F_WRLCK)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self._file(fcntl.F_UNLCK)
        finally:
            self._thread_lock.release()

    def _file(self, kind: int) -> None:
        if _F_OFD_SETLKW is not None:
            try:
                fcntl.fcntl(self._fd, _F_OFD_SETLKW, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
                return
            except OSError as err:
                if err.errno != 22:  # EINVAL: the kernel has no OFD locks
                    raise
        fcntl.flock(self._fd, fcntl.LOCK_UN if kind == fcntl.F_UNLCK else fcntl.LOCK_EX)

    def close(self) -> None:
        os.close(self._fd)
