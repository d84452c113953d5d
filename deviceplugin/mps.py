"""`gpu-share mps`: one supervised MPS control daemon per MPS pool, in its own container.

Running outside the plugin's process means a plugin restart never kills running MPS clients. Per pool the
daemon gets its own pipe, log and shared-memory directories (see mps_paths), sees only the pool's GPUs, is
given the pool's limits, is restarted with backoff when it exits, and is stopped with `quit`. The file
`<mpsRoot>/<pool>/ready` exists exactly while the daemon runs with its limits set; the plugin advertises
the pool's devices only then.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from . import defaults
from .mps_paths import MpsPaths
from .resources import Resource

log = logging.getLogger(__name__)

DEFAULT_CONTROL_BINARY = defaults.MPS_CONTROL_BINARY


class MpsError(RuntimeError):
    """The control daemon could not be started or configured."""


class MpsDaemon:
    """Supervises one pool's control daemon (run in the foreground with -f, so its exit is seen at once)."""

    def __init__(
        self,
        resource: Resource,
        mps_root: str,
        binary: str = DEFAULT_CONTROL_BINARY,
        start_timeout: float = 10.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        self.resource = resource
        self.paths = MpsPaths.of(mps_root, resource.pool.name)
        self.binary = binary
        self.start_timeout = start_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.restarts = 0
        self._stop = threading.Event()
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        gpus = ",".join(dict.fromkeys(u.gpu.uuid for u in self.resource.units))
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.paths.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.paths.log),
            "CUDA_VISIBLE_DEVICES": gpus,
        }

    def limit_commands(self) -> list[str]:
        """Daemon-wide defaults: 1/N of threads and of each GPU's memory for `strict`, none for `proportional`."""
        if self.resource.pool.mps_limits != "strict":
            return []
        units = list({u.gpu.uuid: u for u in self.resource.units}.values())
        replicas = max(u.replicas for u in units)
        commands = [f"set_default_active_thread_percentage {100 // replicas}"]
        for ordinal, unit in enumerate(units):  # ordinals within the daemon's CUDA_VISIBLE_DEVICES
            commands.append(f"set_default_device_pinned_mem_limit {ordinal} {unit.memory_mib // unit.replicas}M")
        return commands

    def start(self) -> None:
        for path in (self.paths.pipe, self.paths.log, self.paths.shm):
            path.mkdir(parents=True, exist_ok=True)
        self.paths.ready.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._supervise, name=f"mps-{self.resource.pool.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the daemon to quit (clients finish), kill it if it will not, and remove the ready marker."""
        self._stop.set()
        self.paths.ready.unlink(missing_ok=True)
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

    def send(self, commands: list[str], timeout: float = 10.0) -> str:
        """Run the control client with these commands on stdin."""
        try:
            result = subprocess.run(
                [self.binary], input="\n".join(commands) + "\n", env=self.env, capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise MpsError(f"{self.binary}: {err}") from None
        if result.returncode != 0:
            raise MpsError(f"{self.binary} {commands[0]!r} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def _supervise(self) -> None:
        delay = self.backoff_initial
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._run_once()
            except MpsError as err:
                log.error("MPS daemon of pool %s: %s", self.resource.pool.name, err)
            self.paths.ready.unlink(missing_ok=True)
            if self._stop.is_set():
                return
            if time.monotonic() - started > self.backoff_max:
                delay = self.backoff_initial  # it ran a good while: restart promptly
            self.restarts += 1
            log.warning("MPS daemon of pool %s exited; restarting in %.1fs", self.resource.pool.name, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff_max)

    def _run_once(self) -> None:
        control = self.paths.pipe / "control"
        control.unlink(missing_ok=True)  # a killed daemon leaves its pipe behind; a client would hang on it
        try:
            self._process = subprocess.Popen([self.binary, "-f"], env=self.env, stdin=subprocess.DEVNULL)
        except OSError as err:
            raise MpsError(f"cannot start {self.binary}: {err}") from None
        deadline = time.monotonic() + self.start_timeout
        while not control.exists():
            if self._process.poll() is not None or time.monotonic() > deadline or self._stop.is_set():
                self._process.kill()
                self._process.wait()
                raise MpsError(f"{self.binary} -f did not create {control} within {self.start_timeout}s")
            self._stop.wait(0.02)
        if self.limit_commands():
            self.send(self.limit_commands())
        self.paths.ready.write_text(f"{self._process.pid}\n")
        log.info("MPS daemon of pool %s ready (pid %d, GPUs %s)", self.resource.pool.name, self._process.pid, self.env["CUDA_VISIBLE_DEVICES"])
        self._process.wait()

