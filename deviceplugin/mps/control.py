"""`gpu-share mps`: one supervised MPS control daemon per MPS pool, in its own container.

Running outside the plugin's process means a plugin restart never kills running MPS clients. Per pool the
daemon gets its own pipe, log and shared-memory directories (see mps_paths), sees only the pool's GPUs, is
given the pool's limits, is restarted with backoff when it exits, and is stopped with `quit`. The file
`<mpsRoot>/<pool>/ready` is written once the daemon runs with its limits set and answers its control pipe;
a SIGKILLed supervisor cannot remove it, so the plugin (MpsLiveness) trusts it only while the daemon also
answers `get_server_list` on the pool's control pipe.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from .. import defaults
from ..model.devices import Resource
from ..model.shares import share_compute_percent, share_memory_mib
from ..signals import child_signal_mask
from .computemode import ComputeModeError, ComputeModes
from .paths import MpsPaths

log = logging.getLogger(__name__)

DEFAULT_CONTROL_BINARY = defaults.MPS_CONTROL_BINARY


class MpsError(RuntimeError):
    """The control daemon could not be started or configured."""


def control(
    binary: str, paths: MpsPaths, commands: list[str], timeout: float, env: dict[str, str] | None = None
) -> str:
    """Run the control client with these commands on stdin, against the pool's pipe directory; its output."""
    env = {**(env or os.environ), "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe), "CUDA_MPS_LOG_DIRECTORY": str(paths.log)}
    try:
        result = subprocess.run(
            [binary],
            input="\n".join(commands) + "\n",
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=child_signal_mask,
        )
    except subprocess.TimeoutExpired:
        raise MpsError(f"{binary} {commands[0]!r}: no answer within {timeout}s") from None
    except OSError as err:
        raise MpsError(f"{binary}: {err}") from None
    if result.returncode != 0:
        raise MpsError(
            f"{binary} {commands[0]!r} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )
    return result.stdout


class MpsLiveness:
    """The plugin's view of each MPS pool: ready while its marker exists AND its control daemon answers.

    The marker is checked on every call (a stat); `get_server_list` is asked at most every `interval` seconds,
    in a short-lived thread, so the caller (the manager, on the gRPC event loop) never waits on a daemon: a pool
    is first reported ready by the call after its first answer. A daemon killed with its pod leaves its marker
    and pipe behind: the next probe fails and the pool's devices go Unhealthy.
    """

    def __init__(self, binary: str = DEFAULT_CONTROL_BINARY, interval: float = 2.0, timeout: float = 2.0) -> None:
        self.binary = binary
        self.interval = interval
        self.timeout = timeout
        self._lock = threading.Lock()
        self._alive: dict[MpsPaths, tuple[bool, float]] = {}  # pool -> (answered, when asked)
        self._probing: set[MpsPaths] = set()

    def ready(self, paths: MpsPaths) -> bool:
        if not paths.ready.exists():
            with self._lock:
                self._alive.pop(paths, None)
            return False
        with self._lock:
            known = self._alive.get(paths)
            start = (known is None or time.monotonic() - known[1] >= self.interval) and paths not in self._probing
            if start:
                self._probing.add(paths)
        if start:
            threading.Thread(target=self.probe, args=(paths,), name=f"mps-probe-{paths.root.name}", daemon=True).start()
        return known is not None and known[0]

    def probe(self, paths: MpsPaths) -> bool:
        """Ask the pool's daemon now, on this thread (at most `timeout`), and remember the answer for `ready`."""
        try:
            control(self.binary, paths, ["get_server_list"], self.timeout)
            alive = True
        except MpsError as err:
            alive = False
            with self._lock:
                was = self._alive.get(paths, (True, 0.0))[0]
            if was:
                log.warning(
                    "MPS pool %s: its ready marker exists but the control daemon does not answer (%s)",
                    paths.root.name,
                    err,
                )
        with self._lock:
            self._alive[paths] = (alive, time.monotonic())
            self._probing.discard(paths)
        return alive


class MpsDaemon:
    """Supervises one pool's control daemon (run in the foreground with -f, so its exit is seen at once)."""

    def __init__(
        self,
        resource: Resource,
        mps_root: str,
        binary: str = DEFAULT_CONTROL_BINARY,
        start_timeout: float = 10.0,
        backoff_initial: float = 1.0,
        backoff_max: float = defaults.MPS_BACKOFF_MAX,
        probe_interval: float = 5.0,
        compute_modes: ComputeModes | None = None,
    ) -> None:
        self.resource = resource
        self.compute_modes = compute_modes or ComputeModes()  # used only for a pool with exclusiveProcess
        self._modes_before: dict[str, int] | None = (
            None  # GPU uuid -> the mode it had, while this daemon set EXCLUSIVE_PROCESS
        )
        self.paths = MpsPaths.of(mps_root, resource.pool.name)
        self.binary = binary
        self.start_timeout = start_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.probe_interval = probe_interval  # seconds between get_server_list asks while the daemon runs
        self.restarts = 0
        self._marked = False  # this supervisor wrote the ready marker (never remove another's)
        self._stop = threading.Event()
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    @property
    def gpus(self) -> str:
        """The pool's GPU UUIDs, as the daemon's CUDA_VISIBLE_DEVICES."""
        return ",".join(dict.fromkeys(u.gpu.uuid for u in self.resource.units))

    @property
    def spec(self) -> tuple:
        """What the daemon is started with (directories, GPUs, limits): a daemon of another spec is another daemon."""
        return (self.paths, self.gpus, tuple(self.limit_commands()), self.resource.pool.exclusive_process)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.paths.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.paths.log),
            "CUDA_VISIBLE_DEVICES": self.gpus,
        }

    def limit_commands(self) -> list[str]:
        """Daemon-wide defaults: 1/N of threads and of each GPU's memory for `strict`, none for `proportional`."""
        if self.resource.pool.mps_limits != "strict":
            return []
        units = list({u.gpu.uuid: u for u in self.resource.units}.values())
        commands = [f"set_default_active_thread_percentage {min(share_compute_percent(u) for u in units)}"]
        for ordinal, unit in enumerate(units):  # ordinals within the daemon's CUDA_VISIBLE_DEVICES
            commands.append(f"set_default_device_pinned_mem_limit {ordinal} {share_memory_mib(unit)}M")
        return commands

    def start(self) -> None:
        for path in (self.paths.pipe, self.paths.log, self.paths.shm):
            path.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._supervise, name=f"mps-{self.resource.pool.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the daemon to quit (clients finish), kill it if it will not, and remove the ready marker."""
        self._stop.set()
        self._unmark()
        process = self._process
        if process is not None and process.poll() is None:
            try:
                self.send(["quit"], timeout=timeout)
                process.wait(timeout)
            except (MpsError, subprocess.TimeoutExpired) as err:
                log.warning("MPS daemon of pool %s did not quit (%s); killing it", self.resource.pool.name, err)
                process.kill()
                process.wait()
        if self._thread:
            self._thread.join()
        if self._modes_before is not None:  # the daemon is gone: the GPUs get back the mode they had
            self.compute_modes.restore(self._modes_before)
            self._modes_before = None

    def send(self, commands: list[str], timeout: float = 10.0) -> str:
        """Run the control client with these commands on stdin."""
        return control(self.binary, self.paths, commands, timeout, self.env)

    def _supervise(self) -> None:
        delay = self.backoff_initial
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._run_once()
            except MpsError as err:
                log.error("MPS daemon of pool %s: %s", self.resource.pool.name, err)
            except Exception:  # the supervisor must outlive any single failure
                log.exception("MPS daemon of pool %s: supervision round failed", self.resource.pool.name)
            self._unmark()
            if self._stop.is_set():
                return
            if time.monotonic() - started > self.backoff_max:
                delay = self.backoff_initial  # it ran a good while: restart promptly
            self.restarts += 1
            log.warning(
                "MPS daemon of pool %s is down; restart %d in %.1fs", self.resource.pool.name, self.restarts, delay
            )
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff_max)

    def _run_once(self) -> None:
        """Start the daemon, set its limits, mark it ready and wait for it to exit; a failed setup kills it."""
        control_pipe = self.paths.pipe / "control"
        if control_pipe.exists() and self._answers():
            raise MpsError(
                f"another control daemon already answers on {control_pipe} (a second gpu-share mps?): not "
                "starting one more"
            )
        control_pipe.unlink(missing_ok=True)  # a killed daemon leaves its pipe behind; a client would hang on it
        if (
            self.resource.pool.exclusive_process and self._modes_before is None
        ):  # kept across restarts, restored by stop()
            try:
                self._modes_before = self.compute_modes.make_exclusive(self.gpus.split(","))
            except ComputeModeError as err:
                raise MpsError(str(err)) from None
        try:
            self._process = subprocess.Popen(
                [self.binary, "-f"], env=self.env, stdin=subprocess.DEVNULL, preexec_fn=child_signal_mask
            )
        except OSError as err:
            raise MpsError(f"cannot start {self.binary}: {err}") from None
        try:
            self._set_up(control_pipe)
        except BaseException:
            self._kill()  # never leave a daemon behind: the next attempt starts a new one
            raise
        self._mark()
        log.info(
            "MPS daemon of pool %s ready (pid %d, GPUs %s)",
            self.resource.pool.name,
            self._process.pid,
            self.env["CUDA_VISIBLE_DEVICES"],
        )
        self._watch()

    def _watch(self) -> None:
        """Until the daemon exits (seen at once), ask it every probe_interval: the marker exists only while it
        answers."""
        assert self._process is not None
        while True:
            try:
                self._process.wait(self.probe_interval)
                return
            except subprocess.TimeoutExpired:
                pass
            if self._stop.is_set():
                return
            try:
                self.send(["get_server_list"], timeout=self.probe_interval)
            except MpsError as err:
                if self._marked:
                    log.error(
                        "MPS daemon of pool %s (pid %d) does not answer (%s): not ready",
                        self.resource.pool.name,
                        self._process.pid,
                        err,
                    )
                    self._unmark()
                continue
            if not self._marked and not self._stop.is_set():
                log.info("MPS daemon of pool %s answers again: ready", self.resource.pool.name)
                self._mark()

    def _answers(self) -> bool:
        try:
            self.send(["get_server_list"], timeout=min(2.0, self.start_timeout))
        except MpsError:
            return False
        return True

    def _mark(self) -> None:
        assert self._process is not None
        self.paths.ready.write_text(f"{self._process.pid}\n")
        self._marked = True

    def _unmark(self) -> None:
        if self._marked:
            self.paths.ready.unlink(missing_ok=True)
            self._marked = False

    def _set_up(self, control_pipe: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout
        while not control_pipe.exists():
            if self._process.poll() is not None:
                raise MpsError(f"{self.binary} -f exited ({self._process.returncode}) before creating {control_pipe}")
            if time.monotonic() > deadline or self._stop.is_set():
                raise MpsError(f"{self.binary} -f did not create {control_pipe} within {self.start_timeout}s")
            self._stop.wait(0.02)
        self.send(self.limit_commands() + ["get_server_list"], timeout=self.start_timeout)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
