"""Pod Events posted off the caller's thread: a bounded outbox that a thread of its own delivers.

The memory watchdog queues an Event right after a kill (`post` never blocks and never raises); the outbox's thread
posts it through the Kubernetes API, so an API call that hangs delays only this thread, never the next watchdog
round. At most `capacity` Events wait: when full, the oldest is dropped and counted (`dropped`,
`gpushare_events_dropped_total`). An Event the API refuses is logged and not retried.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from ..loop import BackgroundLoop

if TYPE_CHECKING:
    from .client import NodeClient

log = logging.getLogger(__name__)

CAPACITY = 256  # Events waiting for the API at most
IDLE_WAIT = 60.0  # seconds the thread sleeps with nothing queued (a post wakes it at once)


class PodEvent(NamedTuple):
    namespace: str
    pod: str
    reason: str
    message: str


class EventOutbox(BackgroundLoop):
    def __init__(self, client: NodeClient, capacity: int = CAPACITY) -> None:
        super().__init__("pod-events")
        self.client = client
        self.dropped = 0  # Events dropped, oldest first, because the outbox was full
        self._queue: deque[PodEvent] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()

    def post(self, namespace: str, pod: str, reason: str, message: str) -> None:
        """Queue a Warning Event on a pod (any thread; returns at once): an EventSink of the watchdog."""
        with self._lock:
            if len(self._queue) >= self._capacity:
                dropped = self._queue.popleft()
                self.dropped += 1
                log.warning(
                    "event outbox full (%d): dropped %s on %s/%s",
                    self._capacity,
                    dropped.reason,
                    dropped.namespace,
                    dropped.pod,
                )
            self._queue.append(PodEvent(namespace, pod, reason, message))
        self.nudge()

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def deliver(self) -> None:
        """Post every queued Event now, on the calling thread, oldest first."""
        while self._post_oldest():
            pass

    def _post_oldest(self) -> bool:
        """Post the oldest queued Event; False when none was queued."""
        with self._lock:
            if not self._queue:
                return False
            event = self._queue.popleft()
        try:
            self.client.pod_event(event.namespace, event.pod, None, event.reason, event.message)
        except Exception as err:  # an API outage costs this Event, never the thread
            log.warning("cannot post event %s on %s/%s: %s", event.reason, event.namespace, event.pod, err)
        return True

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        """Stop the thread (after the Event it is posting, if any); Events still queued are not posted."""
        self._stop_thread()

    def _run(self) -> None:
        self._repeat(self._round, IDLE_WAIT)

    def _round(self) -> float:
        while not self._stop.is_set() and self._post_oldest():  # a stop waits for one API call, not for the queue
            pass
        return IDLE_WAIT
