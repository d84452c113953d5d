"""Reading ResourceClaims for NodePrepareResources: a GET per claim, or a watch cache that has seen its allocation.

`ApiClaims(ref)` returns the claim as the API serves it (resource.k8s.io/v1, a camelCase dict) or raises
ClaimError with a message. With the cache on, a background watch of every namespace's claims keeps only the claims
allocated to this driver on this node's pool (so memory is bounded by what the node can hold, and capped by
`max_cached`); a claim the cache has with the asked UID and an allocation is served from memory, any other is
fetched with a GET (the cache may lag the scheduler by a moment). The watch re-lists after `410 Gone` and backs off
exponentially (to `backoff_max`) on errors; its loop never dies silently.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..logs import RepeatLimiter, safe_text
from ..loop import BackgroundLoop
from .devices import ClaimError
from .prepare import ClaimRef

log = logging.getLogger(__name__)

MAX_CACHED_CLAIMS = 16_384
MAX_EVENT_BYTES = 8 * 1024 * 1024  # one watch event (a claim is at most ~1.5 MiB in etcd)
WATCH_SECONDS = 300  # the server ends each watch after this long; the loop re-watches from the last version
LIST_PAGE = 500


GET_TIMEOUT = 10.0  # seconds for one claim's GET (the kubelet plugin stops beginning claims this long before its deadline)


class ApiClaims:
    def __init__(
        self,
        api_client: Any,
        driver: str,
        pool: str,
        timeout: float = GET_TIMEOUT,
        cache: bool = True,
        max_cached: int = MAX_CACHED_CLAIMS,
        backoff_max: float = 30.0,
    ) -> None:
        from kubernetes import client

        self.api: Any = client.ResourceV1Api(api_client)  # called with _preload_content=False: raw responses
        self.driver = driver
        self.pool = pool
        self.timeout = timeout
        self.max_cached = max_cached
        self.gets = 0  # claims fetched with a GET (cache misses included)
        self._cache: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._lock = threading.Lock()
        self._watch = _ClaimWatch(self, backoff_max) if cache else None

    def start(self) -> None:
        if self._watch:
            self._watch.start()

    def stop(self) -> None:
        if self._watch:
            self._watch.stop()

    @property
    def synced(self) -> bool:
        """The cache has listed once (always True without a cache)."""
        return self._watch.synced.is_set() if self._watch else True

    def __call__(self, ref: ClaimRef) -> Mapping[str, Any]:
        with self._lock:
            cached = self._cache.get((ref.namespace, ref.name))
        live = self._watch is not None and self._watch.live.is_set()  # a cache whose watch failed may be stale
        if live and cached is not None and cached["metadata"].get("uid") == ref.uid and (cached.get("status") or {}).get("allocation"):
            return cached
        return self.get(ref)

    def get(self, ref: ClaimRef) -> Mapping[str, Any]:
        """The claim from the API server; ClaimError naming the claim and the cause."""
        from kubernetes.client.exceptions import ApiException

        self.gets += 1
        try:
            response = self.api.read_namespaced_resource_claim(ref.name, ref.namespace, _preload_content=False, _request_timeout=self.timeout)
            status, body = response.status, response.data
        except ApiException as err:  # the client raises on error statuses even without preloading
            raw = err.body or err.reason or ""
            status, body = err.status or 0, raw if isinstance(raw, bytes) else str(raw).encode()
        except Exception as err:  # connection errors, timeouts: this claim fails, the call goes on
            raise ClaimError(f"claim {ref}: cannot read it from the API: {safe_text(str(err), 300)}") from None
        if status == 404:
            raise ClaimError(f"claim {ref} not found in the API")
        if status != 200:
            raise ClaimError(f"claim {ref}: the API answered {status}: {safe_text(body.decode(errors='replace'), 300)}")
        try:
            claim = json.loads(body)
        except ValueError as err:
            raise ClaimError(f"claim {ref}: the API's answer is not JSON: {err}") from None
        if not isinstance(claim, dict) or not isinstance(claim.get("metadata"), dict):
            raise ClaimError(f"claim {ref}: the API's answer is not a ResourceClaim")
        return claim

    # --- the cache -------------------------------------------------------------------------------
    def _ours(self, claim: Mapping[str, Any]) -> bool:
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
        return any(isinstance(r, dict) and r.get("driver") == self.driver and r.get("pool") == self.pool for r in results)

    def _replace(self, claims: list[Mapping[str, Any]]) -> None:
        fresh: dict[tuple[str, str], Mapping[str, Any]] = {}
        for claim in claims:
            if self._ours(claim) and len(fresh) < self.max_cached:
                fresh[_key(claim)] = claim
        with self._lock:
            self._cache = fresh

    def _apply(self, kind: str, claim: Mapping[str, Any]) -> None:
        key = _key(claim)
        with self._lock:
            if kind == "DELETED" or not self._ours(claim):
                self._cache.pop(key, None)
            elif key in self._cache or len(self._cache) < self.max_cached:
                self._cache[key] = claim

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


def _key(claim: Mapping[str, Any]) -> tuple[str, str]:
    meta = claim.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _slim(claim: Mapping[str, Any]) -> dict[str, Any]:
    """What prepare reads: identity and the allocation (spec and managed fields are dropped)."""
    meta = claim.get("metadata") or {}
    return {
        "metadata": {k: meta.get(k) for k in ("namespace", "name", "uid", "resourceVersion")},
        "status": {"allocation": (claim.get("status") or {}).get("allocation")},
    }


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class _ClaimWatch(BackgroundLoop):
    def __init__(self, claims: ApiClaims, backoff_max: float) -> None:
        super().__init__("dra-claim-watch")
        self.claims = claims
        self.backoff_max = backoff_max
        self.synced = threading.Event()
        self.live = threading.Event()  # listed, and the watch has not failed since: the cache may serve prepare
        self._failures = RepeatLimiter(log, window=60.0)
        self._response: Any = None
        self._response_lock = threading.Lock()

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._response_lock:
            if self._response is not None:
                self._response.shutdown()  # wakes the blocked read
        self._stop_thread()

    def _run(self) -> None:
        delay = 0.5
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list()
                    self.synced.set()
                    self.live.set()
                version = self._watch(version)
                delay = 0.5
            except _Gone:
                self.live.clear()
                version = ""
            except Exception as err:  # API errors, bad JSON, a bug: log, back off, go on
                self.live.clear()
                if self._stop.is_set():
                    return
                self._failures.log(logging.WARNING, (type(err), str(err)[:100]), "ResourceClaim watch failed (%s); prepare GETs claims meanwhile; retrying in %.1fs", safe_text(str(err), 300), delay)
                self._failures.flush()
                version = ""
                self._wake.wait(delay)
                delay = min(delay * 2, self.backoff_max)

    def _list(self) -> str:
        items: list[Mapping[str, Any]] = []
        token: str | None = None
        while True:
            response = self.claims.api.list_resource_claim_for_all_namespaces(
                limit=LIST_PAGE, _continue=token, _preload_content=False, _request_timeout=self.claims.timeout
            )
            if response.status != 200:
                raise RuntimeError(f"list ResourceClaims: {response.status} {safe_text(response.data.decode(errors='replace'), 200)}")
            page = json.loads(response.data)
            # Only this node's claims are kept, page by page: the cluster's claims never sit in memory together.
            items.extend(_slim(c) for c in page.get("items") or () if isinstance(c, dict) and self.claims._ours(c))
            del items[self.claims.max_cached:]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                self.claims._replace(items)
                return str(page["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        response = self.claims.api.list_resource_claim_for_all_namespaces(
            watch=True, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
            _preload_content=False, _request_timeout=(self.claims.timeout, WATCH_SECONDS + 30),
        )
        with self._response_lock:
            self._response = response
        if self._stop.is_set():
            response.shutdown()
        try:
            if response.status == 410:
                raise _Gone()
            if response.status != 200:
                raise RuntimeError(f"watch ResourceClaims: {response.status}")
            for event in _events(response):
                if self._stop.is_set():
                    break
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch ResourceClaims: {safe_text(str(obj.get('message')), 200)}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.claims._apply(str(kind), _slim(obj))
            return version
        finally:
            with self._response_lock:
                self._response = None
            response.release_conn()


def _events(response: Any) -> Iterator[dict[str, Any]]:
    """The watch stream's JSON lines, each bounded."""
    buffer = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        buffer += chunk
        if len(buffer) > MAX_EVENT_BYTES:
            raise RuntimeError(f"a watch event over {MAX_EVENT_BYTES} bytes")
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
