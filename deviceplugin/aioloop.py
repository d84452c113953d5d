"""The one asyncio event loop of the plugin's gRPC side, in a daemon thread.

Every DevicePlugin server, ListAndWatch stream, Register call and kubelet watch runs on it, so an open
stream costs a coroutine, never a thread. Threaded parts (health, reload, agent) call in through `run`
(wait for a result) or `call` (fire and forget).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# The loop shares the GIL with worker threads (a large GetPreferredAllocation placed off the loop, reads of what
# containers hold): with CPython's 5 ms switch interval an Allocate waits up to 5 ms at each of its steps while one
# runs; 1 ms bounds that. It costs nothing while only one thread is runnable.
SWITCH_INTERVAL = 0.001


class EventLoopThread:
    def __init__(self, name: str = "grpc-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(_log_exception)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (never from the loop itself: that would deadlock)."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("EventLoopThread.run called from its own loop")
        return self.submit(coro).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon; safe from any thread, the loop's own included."""
        if self.in_loop():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)


def _log_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An exception nobody awaited (a task that died): logged at ERROR, never silent."""
    log.error("gRPC event loop: %s", context.get("message", "unhandled exception"), exc_info=context.get("exception"))


_shared: EventLoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop() -> EventLoopThread:
    """The process's gRPC loop, started on first use and kept for the process's life."""
    global _shared
    with _shared_lock:
        if _shared is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
            _shared = EventLoopThread()
        return _shared
