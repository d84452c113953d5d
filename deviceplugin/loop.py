"""A background thread that runs until stopped: the shape of every periodic part of the plugin."""

from __future__ import annotations

import threading


class BackgroundLoop:
    """Subclasses implement `_run`, which returns once `self._stop` is set."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
