"""One live instance per plugin directory: a second `gpu-share run` stands by (or exits with a clear error), never
serves beside the first, takes over when the first stops, and a kubelet restart while both run ends with one
instance serving every resource. Real processes, the built-in kubelet."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

from .conftest import registered, start_run, wait_until

SHARE = "example.com/gpu-share"


def endpoints_of(kubelet, pid: int) -> list[str]:
    return [r.endpoint for r in kubelet.register_requests if f"-{pid}-" in r.endpoint]


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    return err


class Logged:
    """The stderr lines of a process, read on a thread of their own."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        assert proc.stderr is not None
        stderr = proc.stderr
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(stderr.readline, "")), daemon=True)
        self.thread.start()

    def line(self, text: str) -> str | None:
        return next((line for line in list(self.lines) if text in line), None)


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 20) -> str:
    """Wait until a stderr line of the process contains `text`; that line."""
    logged = Logged(proc)
    assert wait_until(lambda: logged.line(text) is not None, timeout=timeout), f"{text!r} not logged"
    return logged.line(text) or ""


def test_a_second_instance_stands_by_through_a_kubelet_restart_and_takes_over_when_the_first_stops(kubelet, plugin_dir):
    first = start_run(plugin_dir)
    second = None
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=20)
        second = start_run(plugin_dir)
        line = wait_for_line(second, "standing by")
        assert f"another gpu-share instance (pid {first.pid}) serves the plugin directory {plugin_dir}" in line
        kubelet.restart()  # while both run: only the first registers again
        assert kubelet.wait_for(registered(SHARE), timeout=10)
        assert endpoints_of(kubelet, second.pid) == [] and f"-{first.pid}-" in kubelet.register_requests[-1].endpoint
        assert len(list(plugin_dir.glob("gpu-share-*.sock"))) == 1
        stop(first)
        stopped = time.monotonic()
        assert wait_until(lambda: len(endpoints_of(kubelet, second.pid)) == 1, timeout=15)
        assert kubelet.wait_for(registered(SHARE), timeout=10)
        assert time.monotonic() - stopped < 5  # the stand-by polls the lock every --watch-interval (0.05 s here)
        assert kubelet.resources()[SHARE].allocatable == 20
    finally:
        stop(first)
        if second is not None:
            assert "Traceback" not in stop(second)


def test_a_second_instance_that_stops_leaves_the_first_registered(kubelet, plugin_dir):
    first = start_run(plugin_dir)
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=20)
        second = start_run(plugin_dir)
        logged = Logged(second)
        assert wait_until(lambda: endpoints_of(kubelet, second.pid) or logged.line("standing by"), timeout=20)  # started either way
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
        assert kubelet.wait_for(registered(SHARE), timeout=5)  # not left at allocatable 0 with the first's sockets
        kubelet.restart()  # the first still follows the kubelet: it was never disturbed
        assert kubelet.wait_for(registered(SHARE), timeout=10)
        assert kubelet.resources()[SHARE].allocatable == 20 and f"-{first.pid}-" in kubelet.register_requests[-1].endpoint
        assert endpoints_of(kubelet, second.pid) == []
    finally:
        stop(first)


def test_instance_conflict_exit_ends_the_second_instance_with_a_clear_error(kubelet, plugin_dir):
    first = start_run(plugin_dir)
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=20)
        second = start_run(plugin_dir, "--instance-conflict", "exit")
        err = stop(second) if second.wait(timeout=20) is not None else ""
        assert second.returncode == 1
        assert f"another gpu-share instance (pid {first.pid}) serves the plugin directory {plugin_dir}; exiting (--instance-conflict=exit)" in err
        assert kubelet.resources()[SHARE].registered
    finally:
        stop(first)
