"""One live instance per plugin directory: a second `gpu-share run` stands by (or exits with a clear error), never
serves beside the first, takes over when the first stops, and a kubelet restart while both run ends with one
instance serving every resource. Real processes, the built-in kubelet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

from .conftest import free_port, registered, start_run, wait_until

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
        assert (
            f"the process holding {plugin_dir} (pid {first.pid}: " in line
            and f"has the instance lock of the plugin directory {plugin_dir}: standing by" in line
        )
        assert " run --node " in line  # the holder's command line
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
        assert wait_until(
            lambda: endpoints_of(kubelet, second.pid) or logged.line("standing by"), timeout=20
        )  # started either way
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
        assert kubelet.wait_for(registered(SHARE), timeout=5)  # not left at allocatable 0 with the first's sockets
        kubelet.restart()  # the first still follows the kubelet: it was never disturbed
        assert kubelet.wait_for(registered(SHARE), timeout=10)
        assert (
            kubelet.resources()[SHARE].allocatable == 20 and f"-{first.pid}-" in kubelet.register_requests[-1].endpoint
        )
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
        assert f"the process holding {plugin_dir} (pid {first.pid}: " in err
        assert f"has the instance lock of the plugin directory {plugin_dir}; exiting (--instance-conflict=exit)" in err
        assert kubelet.resources()[SHARE].registered
    finally:
        stop(first)


HOLD = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
    "print('held', flush=True); time.sleep(600)"
)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except urllib.error.URLError:  # not listening yet
        return 0, ""


def test_a_stale_lock_holder_makes_the_standby_not_ready_naming_it_and_the_standby_takes_over_when_it_ends(
    kubelet, plugin_dir
):
    """A process that holds the lock and serves nothing: after --standby-timeout /readyz says so (503) with its PID
    and command line, /healthz stays 200, gpushare_instance_standby is 1; the standby serves once it ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(plugin_dir)], stdout=subprocess.PIPE, text=True)
    second = None
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        port = free_port()
        second = start_run(
            plugin_dir, "--metrics-port", str(port), "--metrics-bind-address", "127.0.0.1", "--standby-timeout", "0.2"
        )
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: get(f"{base}/readyz")[0] == 503, timeout=20)
        status, text = get(f"{base}/readyz")
        assert status == 503 and "over --standby-timeout 0.2s), serving nothing" in text
        assert f"the process holding {plugin_dir} (pid {holder.pid}: {sys.executable} -c import fcntl" in text
        assert get(f"{base}/healthz")[0] == 200
        metrics = get(f"{base}/metrics")[1]
        assert any(
            line.startswith("gpushare_instance_standby{") and line.endswith(" 1.0") for line in metrics.splitlines()
        ), metrics
        assert endpoints_of(kubelet, second.pid) == []
        holder.kill()
        holder.wait(timeout=10)
        assert wait_until(lambda: len(endpoints_of(kubelet, second.pid)) == 1, timeout=15)
        assert kubelet.wait_for(registered(SHARE), timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=10)
        if second is not None:
            assert "Traceback" not in stop(second)


REFUSE_FLOCK = textwrap.dedent("""
    import errno, fcntl, os
    _flock = fcntl.flock
    def flock(fd, op):  # the kernel's answer on a filesystem that refuses locks (NFS without lockd, 9p)
        if os.readlink(f"/proc/self/fd/{fd}").startswith(os.environ["REFUSE_FLOCK_UNDER"]):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return _flock(fd, op)
    fcntl.flock = flock
""")


def test_a_filesystem_refusing_flock_is_one_clear_error_naming_the_directory_and_the_flag(
    kubelet, plugin_dir, tmp_path
):
    (tmp_path / "sitecustomize.py").write_text(REFUSE_FLOCK)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
        "REFUSE_FLOCK_UNDER": str(plugin_dir),
    }
    from .conftest import EXAMPLES, GPU_CLI

    command = [
        *GPU_CLI,
        "run",
        "--node",
        str(EXAMPLES / "nodes" / "2xT4.yaml"),
        "--plugin-dir",
        str(plugin_dir),
        "--watch-interval",
        "0.05",
        "--metrics-port",
        "0",
    ]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"the filesystem of {plugin_dir} refuses flock (No locks available)" in refused.stderr
    assert "choose a lock path on a local filesystem with --instance-lock PATH" in refused.stderr
    elsewhere = subprocess.Popen(
        [*command, "--instance-lock", str(tmp_path / "gpu-share.lock")], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert kubelet.wait_for(registered(SHARE), timeout=20)  # a lock on another filesystem: it serves
        assert f"-{elsewhere.pid}-" in kubelet.register_requests[-1].endpoint
    finally:
        assert "Traceback" not in stop(elsewhere)
