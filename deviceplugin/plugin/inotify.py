"""Directory change notification through Linux inotify (libc via ctypes), for an asyncio loop.

The kubelet-restart signal is a CREATE of kubelet.sock in the device-plugin directory
(docs/kubelet.md#kubelet-restarts); the NVIDIA plugin and the upstream stub watch it the same way. Where
inotify is unavailable (not Linux, no instances left) `DirectoryWatch.open` returns None and the caller falls
back to polling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
from pathlib import Path

log = logging.getLogger(__name__)

IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_Q_OVERFLOW = 0x4000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")
_READ_BYTES = 64 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1  # noqa: B018 - raises AttributeError where inotify does not exist
    except (OSError, AttributeError):
        return None
    return libc


class DirectoryWatch:
    """A non-blocking inotify descriptor watching one directory for entries created, deleted or moved."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, directory: Path) -> DirectoryWatch | None:
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.warning("inotify unavailable (%s); polling %s instead", os.strerror(ctypes.get_errno()), directory)
            return None
        mask = IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE_SELF
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            log.warning(
                "cannot watch %s with inotify (%s); polling instead", directory, os.strerror(ctypes.get_errno())
            )
            os.close(fd)
            return None
        return cls(fd)

    def read(self) -> list[str] | None:
        """Names of the entries that changed since the last read; None when events were lost (overflow)."""
        names: list[str] = []
        while True:
            try:
                data = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return names
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size
                if mask & IN_Q_OVERFLOW:
                    return None
                names.append(os.fsdecode(data[offset : offset + length].rstrip(b"\0")))
                offset += length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
