"""Process signals and limits of the long-running commands (`run`, `mps`).

SIGTERM/SIGINT are blocked in every thread and taken by one watcher thread with `sigwait`, so a signal can never
land on a gRPC thread and be lost, and one that arrives while start-up hangs still ends the process. Children
must not inherit the blocked mask: `child_signal_mask` restores it in the child before exec.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from .defaults import SHUTDOWN_GRACE

log = logging.getLogger("gpu-share")

SIGNALS = {signal.SIGTERM, signal.SIGINT}

_stop = threading.Event()
_grace = SHUTDOWN_GRACE


def catch_signals(grace: float = SHUTDOWN_GRACE) -> None:
    """Block SIGTERM/SIGINT before any other thread starts (every later thread, gRPC's included, inherits the mask)
    and take them in one watcher thread with `sigwait`: a signal can never be lost on a gRPC thread, and one that
    arrives while start-up hangs (a wedged driver) still ends the process within SHUTDOWN_GRACE."""
    global _grace
    _grace = grace
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    threading.Thread(target=_watch_signals, name="signals", daemon=True).start()


def _watch_signals() -> None:
    received = signal.sigwait(SIGNALS)
    log.info("%s received, shutting down", signal.Signals(received).name)
    _stop.set()
    deadline = threading.Timer(_grace, _force_exit)
    deadline.daemon = True
    deadline.start()


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT (or return at once if one came during start-up)."""
    _stop.wait()


def stop_requested(timeout: float) -> bool:
    """Wait up to `timeout` seconds for SIGTERM or SIGINT; True once one came."""
    return _stop.wait(timeout)


def raise_fd_limit() -> None:
    """Use the hard limit of open files: the default soft limit (1024) is small for a server many can connect to."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def exit_now(status: int) -> NoReturn:
    """End the process with `status`, logs and stdio flushed, skipping the interpreter's teardown: after a clean stop
    nothing is left to release, and tearing down grpc, protobuf and kubernetes (0.2-0.5 s) only delays the exit a
    DaemonSet rolling update waits for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(status)


def _force_exit() -> None:
    log.error("shutdown took longer than %gs (--shutdown-grace); exiting now", _grace)
    logging.shutdown()
    os._exit(1)


def child_signal_mask() -> None:
    """`preexec_fn` for subprocesses: unblock the signals this process blocked, so the child can be stopped."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
