"""Nodes and Pods from the API server into the cache: list (paged), then watch from the list's resourceVersion.

A watch that ends (the server's timeout) is resumed from the last resourceVersion seen (bookmarks keep it
fresh); 410 Gone relists at once; any other error relists after a back-off doubling up to `backoff_max`.
The cache keeps serving the last state meanwhile. Objects are read as plain JSON (no model classes).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..kube.errors import error_line
from ..kube.rest import ApiError, RestClient
from ..kube.watch import Gone, ResponseTooLarge, raise_for_error, watch_events
from ..loop import BackgroundLoop
from .cache import ClusterCache, pod_state
from .dra import claim_info, claim_requests, slice_info
from .inputs import InputError, host_capacity, pod_request

log = logging.getLogger(__name__)

PAGE = 500
RESOURCE = "/apis/resource.k8s.io/v1"
MAX_PAGE_BYTES = 32 * 1024 * 1024  # one list page's body; a page over it is read again at half the size, down to 1
POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"
MAX_LINE_BYTES = 16 * 1024 * 1024  # one watch event; a Node or Pod is far smaller


def settle_heap() -> None:
    """After a full list: move the cache's long-lived objects out of the cyclic GC's reach.

    Otherwise each full collection walks every cached unit (hundreds of thousands of objects at 5,000 nodes)
    inside some filter call: measured, that is the p99 of filter + prioritize. Frozen objects are still freed
    by reference counting when the cache drops them.
    """
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class WatchSettings:
    watch_timeout: int = 300  # seconds the API server keeps one watch open
    request_timeout: float = 30.0  # connect/read timeout of one list page; a watch reads up to watch_timeout + this
    backoff_initial: float = 0.5
    backoff_max: float = 30.0


class ResourceWatch(BackgroundLoop):
    """One kind (nodes or pods): list into the cache, then apply watch events."""

    def __init__(
        self,
        kind: str,
        api: RestClient,
        path: str,
        apply_list: Callable[[list[dict]], None],
        apply_event: Callable[[str, dict], None],
        settings: WatchSettings = WatchSettings(),
        on_restart: Callable[[], None] = lambda: None,
        field_selector: str = "",
    ) -> None:
        super().__init__(f"watch-{kind}")
        self.kind = kind
        self.api, self.path = api, path
        self.apply_list = apply_list
        self.apply_event = apply_event
        self.settings = settings
        self.on_restart = on_restart
        self.field_selector = field_selector
        self.synced = False  # one full list applied
        self.last_error = ""
        self._response = None  # the open watch, shut down by stop()

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            response.shutdown()  # unblocks the read in the watch thread
        self._stop_thread()

    def _run(self) -> None:
        delay = self.settings.backoff_initial
        while not self._stop.is_set():
            try:
                version = self._list()
                self.synced, self.last_error = True, ""
                delay = self.settings.backoff_initial
                while not self._stop.is_set():
                    version = self._watch(version)
            except Gone:
                log.info("%s watch: resourceVersion expired, listing again", self.kind)
                self.on_restart()
            except Exception as err:  # the loop must never die: log, back off, relist
                if self._stop.is_set():  # stop() shut the stream: no warning for a clean SIGTERM
                    return
                self.last_error = error_line(err)  # one line: an ApiException's str() carries every header
                log.warning("%s watch failed (%s); listing again in %.1fs", self.kind, self.last_error, delay)
                self.on_restart()
                self._stop.wait(delay)
                delay = min(delay * 2, self.settings.backoff_max)

    def _list(self) -> str:
        """Every page, each body at most MAX_PAGE_BYTES: a page over it is read again with half the limit (large
        objects, e.g. another tenant's claims at the API's maxima); one object over it fails the list."""
        items: list[dict] = []
        token: str | None = None
        limit = PAGE
        while True:
            try:
                page = self.api.list(
                    self.path,
                    field_selector=self.field_selector or None,
                    limit=limit,
                    continue_=token,
                    timeout=self.settings.request_timeout,
                    max_bytes=MAX_PAGE_BYTES,
                )
            except ResponseTooLarge:
                if limit == 1:
                    raise
                limit = max(1, limit // 2)
                log.info("%s list: a page over %d bytes; reading %d per page", self.kind, MAX_PAGE_BYTES, limit)
                continue
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        self.apply_list(items)
        return str((page.get("metadata") or {}).get("resourceVersion", ""))

    def _watch(self, version: str) -> str:
        """Apply events until the server ends the watch; returns the last resourceVersion seen."""
        try:
            response = self.api.watch(
                self.path,
                version,
                field_selector=self.field_selector or None,
                seconds=self.settings.watch_timeout,
                silence=self.settings.watch_timeout + self.settings.request_timeout,
            )
        except ApiError as err:
            if err.status == 410:
                raise Gone() from None
            raise
        self._response = response
        try:
            for event in watch_events(response, MAX_LINE_BYTES, self._stop):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise_for_error(obj, self.kind)
                version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.apply_event(kind, obj)
        finally:
            self._response = None
            response.close()
            response.release_conn()
        return version


class ClusterWatch:
    """The watches that keep the cache current: Nodes (their annotation and allocatable) and Pods (bound or
    nominated, every pod: all of them take CPU, memory and a pod slot); with DRA (the cache's driver set) also the
    driver's ResourceSlices, every ResourceClaim and ResourceClaimTemplate."""

    def __init__(
        self,
        api: RestClient,
        cache: ClusterCache,
        annotation_key: str,
        managed: Callable[[str], bool],
        settings: WatchSettings = WatchSettings(),
        on_restart: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.cache = cache
        self.annotation_key = annotation_key
        self.managed = managed
        self.nodes = ResourceWatch(
            "nodes", api, "/api/v1/nodes", self._nodes, self._node_event, settings, lambda: on_restart("nodes")
        )
        self.pods = ResourceWatch(
            "pods", api, "/api/v1/pods", self._pods, self._pod_event, settings, lambda: on_restart("pods"), POD_SELECTOR
        )
        self.watches = [self.nodes, self.pods]
        if cache.driver:
            self.watches += [
                ResourceWatch(
                    "resourceslices",
                    api,
                    f"{RESOURCE}/resourceslices",
                    self._slices,
                    self._slice_event,
                    settings,
                    lambda: on_restart("resourceslices"),
                    f"spec.driver={cache.driver}",
                ),
                ResourceWatch(
                    "resourceclaims",
                    api,
                    f"{RESOURCE}/resourceclaims",
                    self._claims,
                    self._claim_event,
                    settings,
                    lambda: on_restart("resourceclaims"),
                ),
                ResourceWatch(
                    "resourceclaimtemplates",
                    api,
                    f"{RESOURCE}/resourceclaimtemplates",
                    self._templates,
                    self._template_event,
                    settings,
                    lambda: on_restart("resourceclaimtemplates"),
                ),
            ]

    def start(self) -> None:
        for watch in self.watches:
            watch.start()

    def stop(self) -> None:
        for watch in self.watches:
            watch.stop()

    def ready(self) -> tuple[bool, str]:
        waiting = [w.kind + (f" ({w.last_error})" if w.last_error else "") for w in self.watches if not w.synced]
        return (
            not waiting,
            "ready" if not waiting else f"not ready: waiting for the first list of {', '.join(waiting)}",
        )

    def _annotation(self, node: dict) -> str | None:
        return ((node.get("metadata") or {}).get("annotations") or {}).get(self.annotation_key)

    def _nodes(self, items: list[dict]) -> None:
        self.cache.replace_nodes({n["metadata"]["name"]: (self._annotation(n), host_capacity(n)) for n in items})
        settle_heap()

    def _node_event(self, kind: str, node: dict) -> None:
        name = node["metadata"]["name"]
        if kind == "DELETED":
            self.cache.delete_node(name)
        else:
            self.cache.set_node(name, self._annotation(node), host_capacity(node))

    def _state(self, pod: dict):
        try:
            return pod_state(pod, pod_request(pod, self.managed))
        except InputError as err:
            log.debug("pod %s ignored: %s", (pod.get("metadata") or {}).get("name"), err)
            return None

    def _pods(self, items: list[dict]) -> None:
        self.cache.replace_pods(s for s in map(self._state, items) if s is not None)
        settle_heap()

    def _pod_event(self, kind: str, pod: dict) -> None:
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        state = None if kind == "DELETED" else self._state(pod)
        if state is None:
            self.cache.delete_pod(uid)
        else:
            self.cache.set_pod(state)

    # --- DRA ----------------------------------------------------------------------------------------
    def _slices(self, items: list[dict]) -> None:
        infos = {str(o["metadata"]["name"]): slice_info(o, self.cache.driver) for o in items}
        self.cache.replace_slices({k: v for k, v in infos.items() if v is not None})

    def _slice_event(self, kind: str, obj: dict) -> None:
        self.cache.set_slice(
            str(obj["metadata"]["name"]), None if kind == "DELETED" else slice_info(obj, self.cache.driver)
        )

    def _claims(self, items: list[dict]) -> None:
        self.cache.replace_claims({_key(o): claim_info(o, self.cache.driver, self.cache.classes) for o in items})

    def _claim_event(self, kind: str, obj: dict) -> None:
        self.cache.set_claim(
            _key(obj), None if kind == "DELETED" else claim_info(obj, self.cache.driver, self.cache.classes)
        )

    def _templates(self, items: list[dict]) -> None:
        self.cache.replace_templates(
            {_key(o): claim_requests((o.get("spec") or {}).get("spec") or {}, self.cache.classes) for o in items}
        )

    def _template_event(self, kind: str, obj: dict) -> None:
        requests = (
            None if kind == "DELETED" else claim_requests((obj.get("spec") or {}).get("spec") or {}, self.cache.classes)
        )
        self.cache.set_template(_key(obj), requests)


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))
