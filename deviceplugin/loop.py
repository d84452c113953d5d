"""A background thread that runs until stopped: the shape of every periodic part of the plugin, and the clock parts
read (injected, so tests drive time instead of sleeping)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Seconds on a monotonic scale (`time.monotonic`; a test's fake clock)."""


class BackgroundLoop:
    """Subclasses implement `_run`, which returns once `self._stop` is set (`_repeat` is the usual body)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._stop = threading.Event()
        self._wake = threading.Event()  # cuts a `_repeat` wait short: stop, or `nudge`
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The thread's name: what the loop does."""
        return self._name

    @property
    def running(self) -> bool:
        """The thread was started and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    def nudge(self) -> None:
        """Run the next `_repeat` round now (any thread)."""
        self._wake.set()

    def _run(self) -> None:
        raise NotImplementedError

    def _repeat(self, round: Callable[[], float], retry: float) -> None:
        """Call `round` until stopped, waiting the seconds it returns (or a nudge) in between. A round that raises is
        logged with its traceback and the loop goes on after `retry` seconds: it never dies silently."""
        while not self._stop.is_set():
            self._wake.clear()  # a nudge from now on is seen by this round or ends the wait after it
            try:
                delay = round()
            except Exception:
                log.exception("%s: round failed; trying again in %.1fs", self._name, retry)
                delay = retry
            if delay > 0:
                self._wake.wait(delay)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """End the loop's wait now without waiting for the thread (any thread): a stop of several parts asks each
        first, so their last rounds end side by side; `stop` joins."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for it (after the round in progress, if any)."""
        self._stop_thread()

    def _stop_thread(self) -> None:
        self.request_stop()
        if self._thread:
            self._thread.join()
