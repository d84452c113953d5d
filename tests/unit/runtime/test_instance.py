"""The instance lock's words about its holder: PID and a bounded command line, read from a real /proc."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from deviceplugin.cli.run import _standby_readiness
from deviceplugin.runtime.instance import MAX_CMDLINE_BYTES, InstanceLock, command_line

HOLD = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
    "print('held', flush=True); time.sleep(600)"
)


def test_the_command_line_is_read_bounded_and_printable():
    word = "x" * (2 * MAX_CMDLINE_BYTES)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", "a\tb", word],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # exec'd: its own command line
        text = command_line(proc.pid)
        assert text is not None and text.startswith(f"{sys.executable} -c import sys") and text.endswith("…")
        assert " a?b xxx" in text  # a control character shows as ?
        assert len(text.encode()) <= MAX_CMDLINE_BYTES + len("…".encode())
    finally:
        proc.communicate(b"")
    assert command_line(proc.pid) is None  # gone: unreadable, no guess


def test_a_lock_file_names_its_holder_and_the_standby_is_ready_only_within_its_bound(tmp_path):
    path = tmp_path / "gpu-share.lock"
    lock = InstanceLock(tmp_path, path)
    assert lock.try_acquire() and path.exists()
    lock.release()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert not lock.try_acquire() and lock.holder() == holder.pid
        ready, text = _standby_readiness(lock, time.monotonic(), 3600)
        assert ready and text.startswith(
            f"standby: the process holding {path} (pid {holder.pid}: {sys.executable} -c import fcntl"
        )
        ready, text = _standby_readiness(lock, time.monotonic() - 40, 30)
        assert not ready and text.startswith(
            "not ready: standing by for 40s (over --standby-timeout 30s), serving nothing: the process holding"
        )
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert lock.try_acquire()  # the kernel released it with the process
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the lock is not held")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
        lock.release()
