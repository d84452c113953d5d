"""The one list-then-watch loop: list (paged, each page bounded by bytes), then watch from the list's resourceVersion,
in a thread of its own, until `stop()`.

Used by the extender's Nodes, Pods, slices, claims and templates (`extender/watch.py`), the DRA driver's
ResourceClaim cache (`dra/claims.py`) and its slice publisher (`dra/slices.py`); each adds only what it does with
the objects (`_page`, `_listed`, `_event`) and, if it likes, how it reports a failure (`_failed`) or a restart
(`_restarting`).

The rules, the same for all:
- A list page holds at most `page` objects and its body at most `max_page_bytes`; a page over it is read again at
  half the size, down to one object, which fails the list. `list_pages` stops after that many pages (the
  resourceVersion is all the caller needs).
- A watch event is at most `max_event_bytes` (`kube.watch.watch_events`). Every event or bookmark moves the
  resourceVersion and `heard`. When the server ends a watch, the next one resumes from the last version seen
  (`resume`), or the loop lists again.
- 410 Gone (opening the watch, or an ERROR event) lists again at once; so does a stream silent for `silence`
  seconds (no event, no bookmark: the socket's read timeout). Any other error lists again after a back-off,
  `backoff_initial` doubling to `backoff_max`, reset once a watch ends normally. The loop never dies; a `stop()`
  ends it without a warning, within a request timeout.
- `synced`: listed once; `live`: listed and not failed since; `current()`: live, and heard from within `silence`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..logs import RepeatLimiter
from ..loop import BackgroundLoop
from .errors import error_line
from .rest import ApiError, RestClient
from .watch import Gone, ResponseTooLarge, Silent, raise_for_error, watch_events

log = logging.getLogger(__name__)

CHANGES = ("ADDED", "MODIFIED", "DELETED")


class ListWatch(BackgroundLoop):
    """List `path` then watch it (a subclass adds `_page`, `_listed` and `_event`); `what` names it in the logs."""

    def __init__(
        self,
        name: str,
        what: str,
        api: RestClient | None,
        path: str,
        *,
        page: int,
        max_page_bytes: int,
        max_event_bytes: int,
        request_timeout: float,
        field_selector: str | None = None,
        watch_seconds: int = 300,
        silence: float | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        resume: bool = True,
        list_pages: int | None = None,
    ) -> None:
        """`silence`: seconds a watch may deliver nothing (default: the server's end, `watch_seconds`, plus
        `request_timeout`)."""
        super().__init__(name)
        self.what = what
        self.api, self.path, self.field_selector = api, path, field_selector or None
        self.page, self.max_page_bytes, self.max_event_bytes = page, max_page_bytes, max_event_bytes
        self.list_pages = list_pages
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self.silence = watch_seconds + request_timeout if silence is None else silence
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.resume = resume
        self.synced = threading.Event()  # listed once
        self.live = threading.Event()  # listed, and the watch has not failed since
        self.heard = float("-inf")  # time.monotonic() of the last list, event or bookmark
        self.last_error = ""  # the last failure, one line; "" once a list succeeds
        self.streams = 0  # watch streams opened
        self._errors = RepeatLimiter(log, window=60.0)
        self._response: Any = None  # the open watch, shut down by stop()
        self._response_lock = threading.Lock()

    # --- what a subclass adds -------------------------------------------------------------------
    def _page(self, items: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
        """One list page's objects: keep what `_listed` needs in `kept` (all of them, unless overridden)."""
        kept.extend(items)

    def _listed(self, kept: list[dict[str, Any]]) -> None:
        """The list is complete: what `_page` kept."""

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        """One ADDED, MODIFIED or DELETED event."""

    def _restarting(self) -> None:
        """The watch broke (410 Gone, silence or a failure): the loop lists again."""

    def _failed(self, err: Exception, delay: float) -> None:
        """A failure (not Gone, not silence), before the loop waits `delay` seconds and lists again."""
        self._errors.log(
            logging.WARNING,
            (type(err), str(err)[:100]),
            "%s watch failed (%s); listing again in %.1fs",
            self.what,
            self.last_error,
            delay,
        )
        self._errors.flush()

    # --- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        self._start_thread()

    def current(self) -> bool:
        """Listed, not failed since, and heard from (an event or a bookmark) within `silence` seconds."""
        return self.live.is_set() and time.monotonic() - self.heard < self.silence

    def stop(self) -> None:
        self.request_stop()
        with self._response_lock:
            if self._response is not None:
                try:
                    self._response.shutdown()  # wakes the blocked read
                except OSError:  # the stream has just ended and its socket is closed: nothing is blocked on it
                    pass
        self._stop_thread()

    def _run(self) -> None:
        delay = self.backoff_initial
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list()
                version = self._watch(version)
                delay = self.backoff_initial
                if not self.resume:
                    version = ""
            except (Gone, Silent) as err:
                self.live.clear()
                version = ""
                if self._stop.is_set():
                    return
                if isinstance(err, Gone):
                    log.info("%s watch: resourceVersion expired, listing again", self.what)
                else:
                    log.info("%s watch silent for %.0fs (no event or bookmark); listing again", self.what, self.silence)
                self._restarting()
            except Exception as err:  # API errors, bad JSON, a bug: log (one line), back off, list again
                self.live.clear()
                version = ""
                if self._stop.is_set():  # stop() shut the stream: no warning for a clean SIGTERM
                    return
                self.last_error = error_line(err)  # one line: an ApiError's str() may carry a long body
                self._failed(err, delay)
                self._restarting()
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_max)

    @property
    def _client(self) -> RestClient:
        if self.api is None:
            raise ApiError(0, "NoApi", "no Kubernetes API configured")
        return self.api

    def _list(self) -> str:
        """Every page (or the first `list_pages`) through `_page`, then `_listed`; the list's resourceVersion."""
        kept: list[dict[str, Any]] = []
        token: str | None = None
        limit, pages, version = self.page, 0, ""
        while True:
            try:
                found = self._client.list(
                    self.path,
                    field_selector=self.field_selector,
                    limit=limit,
                    continue_=token,
                    timeout=self.request_timeout,
                    max_bytes=self.max_page_bytes,
                )
            except ResponseTooLarge:
                if limit == 1:
                    raise
                limit = max(1, limit // 2)
                log.info("%s list: a page over %d bytes; reading %d per page", self.what, self.max_page_bytes, limit)
                continue
            meta = found.get("metadata") or {}
            version = str(meta.get("resourceVersion") or "")
            token = meta.get("continue")
            self._page([o for o in found.pop("items", None) or () if isinstance(o, dict)], kept)
            pages += 1
            if not token or pages == self.list_pages:
                break
        self._listed(kept)
        self.heard = time.monotonic()
        self.last_error = ""
        self.synced.set()
        self.live.set()
        return version

    def _watch(self, version: str) -> str:
        """Events until the server ends the watch (or `stop()`); the last resourceVersion seen."""
        try:
            response = self._client.watch(
                self.path,
                version,
                field_selector=self.field_selector,
                seconds=self.watch_seconds,
                silence=self.silence,
            )
        except ApiError as err:
            if err.status == 410:
                raise Gone() from None
            raise
        with self._response_lock:
            if self._stop.is_set():
                response.close()
                response.release_conn()
                return version
            self._response = response
        self.streams += 1
        try:
            for event in watch_events(response, self.max_event_bytes, self._stop):
                if self._stop.is_set():
                    break
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise_for_error(obj, self.what)
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                self.heard = time.monotonic()  # an event or a bookmark: current up to `version`
                if kind in CHANGES:
                    self._event(str(kind), obj)
        finally:
            with self._response_lock:
                self._response = None
            response.close()  # a stream's connection is not reused (a body left unread, or a server that closes it)
            response.release_conn()
        return version
