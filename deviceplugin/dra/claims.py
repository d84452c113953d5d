"""Reading ResourceClaims for NodePrepareResources: a GET per claim, or a watch cache that is provably current.

`ApiClaims.get(ref, timeout)` returns the claim as the API serves it (resource.k8s.io/v1, a camelCase dict) or
raises ClaimError with a message; its client makes no retries, so `timeout` is the read's whole budget. With the
cache on, a background watch of every namespace's claims keeps only what prepare reads of the claims allocated to
this driver on this node's pool (identity, this driver's results and opaque configs: never another driver's
configs), so memory is bounded by what the node can hold, and capped by `max_cached`. The list is read in small
pages (`LIST_PAGE` claims, each page at most `MAX_PAGE_BYTES`), so another tenant's large claims never sit in
memory together.

`cached(ref)` answers from memory only while the cache is provably current: listed, and the watch has delivered an
event or a bookmark (the API server sends one about every minute) within `MAX_SILENCE` seconds. A watch silent for
longer ends itself (the socket's read timeout) and lists again. The driver still GETs a claim's first prepare
(`prepare.Unconfirmed`). The watch re-lists after `410 Gone` and backs off exponentially (to `backoff_max`) on
errors; its loop (`kube.listwatch`) never dies silently, and `stop()` ends it without a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..kube.listwatch import ListWatch
from ..kube.rest import ApiError, RestClient
from ..kube.watch import ResponseTooLarge
from .devices import ClaimError
from .prepare import GONE, UNKNOWN, ClaimRef

log = logging.getLogger(__name__)

MAX_CACHED_CLAIMS = 16_384
MAX_EVENT_BYTES = 8 * 1024 * 1024  # one watch event (a claim is at most ~1.5 MiB in etcd)
WATCH_SECONDS = 300  # the server ends each watch after this long; the loop re-watches from the last version
MAX_SILENCE = 75.0  # seconds without an event or bookmark after which the cache is not trusted and the watch ends
LIST_PAGE = 16  # claims per list page: 16 of the API's largest claims are a few MiB
MAX_PAGE_BYTES = 32 * 1024 * 1024


CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
MAX_CLAIM_BYTES = 4 * 1024 * 1024  # one claim's GET (a claim is at most ~1.5 MiB in etcd)
GET_TIMEOUT = (
    10.0  # seconds for one claim's GET (the kubelet plugin stops beginning claims this long before its deadline)
)


class ApiClaims:
    def __init__(
        self,
        api: RestClient | None,
        driver: str,
        pool: str,
        timeout: float = GET_TIMEOUT,
        cache: bool = True,
        max_cached: int = MAX_CACHED_CLAIMS,
        backoff_max: float = 30.0,
        silence: float = MAX_SILENCE,
    ) -> None:
        self.api = api  # no retries: a call's timeout is its whole budget
        self.driver = driver
        self.pool = pool
        self.timeout = timeout
        self.max_cached = max_cached
        self.silence = silence  # seconds without an event or bookmark after which the cache is not current
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

    @property
    def current(self) -> bool:
        """The cache is listed and its watch has been heard from within MAX_SILENCE seconds."""
        return self._watch is not None and self._watch.current()

    def cached(self, ref: ClaimRef) -> Mapping[str, Any] | None:
        if not self.current:  # a cache whose watch failed or went quiet may be stale
            return None
        with self._lock:
            cached = self._cache.get((ref.namespace, ref.name))
        if (
            cached is not None
            and cached["metadata"].get("uid") == ref.uid
            and (cached.get("status") or {}).get("allocation")
        ):
            return cached
        return None

    def find(self, uid: str) -> Mapping[str, Any] | str:
        """The cached claim with `uid` allocated to this driver on this node; GONE when a current, complete cache has
        none; UNKNOWN when that cannot be told."""
        if not self.current:
            return UNKNOWN
        with self._lock:
            if len(self._cache) >= self.max_cached:
                return UNKNOWN
            for claim in self._cache.values():
                if claim["metadata"].get("uid") == uid:
                    return claim
        return GONE

    def get(self, ref: ClaimRef, timeout: float | None = None) -> Mapping[str, Any]:
        """The claim from the API server within `timeout` (at most `self.timeout`) seconds; ClaimError naming the
        claim and the cause."""
        self.gets += 1
        budget = self.timeout if timeout is None else max(0.1, min(timeout, self.timeout))
        if self.api is None:
            raise ClaimError(f"claim {ref}: no Kubernetes API")
        path = f"/apis/resource.k8s.io/v1/namespaces/{ref.namespace}/resourceclaims/{ref.name}"
        try:
            claim = self.api.get(path, timeout=budget, max_bytes=MAX_CLAIM_BYTES)
        except ApiError as err:
            if err.status == 404:
                raise ClaimError(f"claim {ref} not found in the API") from None
            if err.status:
                raise ClaimError(f"claim {ref}: the API answered {err}") from None
            raise ClaimError(f"claim {ref}: cannot read it from the API: {err.message}") from None
        except ResponseTooLarge as err:
            raise ClaimError(f"claim {ref}: {err}") from None
        if not isinstance(claim.get("metadata"), dict):
            raise ClaimError(f"claim {ref}: the API's answer is not a ResourceClaim")
        return claim

    # --- the cache -------------------------------------------------------------------------------
    def _ours(self, claim: Mapping[str, Any]) -> bool:
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
        return any(
            isinstance(r, dict) and r.get("driver") == self.driver and r.get("pool") == self.pool for r in results
        )

    def _replace(self, claims: Sequence[Mapping[str, Any]]) -> None:
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

    def size(self) -> int:
        """Claims in the cache."""
        with self._lock:
            return len(self._cache)


def _key(claim: Mapping[str, Any]) -> tuple[str, str]:
    meta = claim.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _slim(claim: Mapping[str, Any], driver: str) -> dict[str, Any]:
    """What prepare reads: identity, `driver`'s results and opaque configs (spec, managed fields, other drivers'
    results and configs are dropped)."""
    meta = claim.get("metadata") or {}
    allocation: Any = (claim.get("status") or {}).get("allocation")
    devices = allocation.get("devices") if isinstance(allocation, dict) else None
    if isinstance(allocation, dict) and isinstance(devices, dict):
        results: list[Any] = devices["results"] if isinstance(devices.get("results"), list) else []
        configs: list[Any] = devices["config"] if isinstance(devices.get("config"), list) else []
        allocation = {
            "devices": {
                "results": [r for r in results if isinstance(r, dict) and r.get("driver") == driver],
                "config": [
                    c
                    for c in configs
                    if isinstance(c, dict) and isinstance(c.get("opaque"), dict) and c["opaque"].get("driver") == driver
                ],
            },
            **{k: allocation[k] for k in ("nodeSelector", "allocationTimestamp") if k in allocation},
        }
    return {
        "metadata": {k: meta.get(k) for k in ("namespace", "name", "uid", "resourceVersion")},
        "status": {"allocation": allocation},
    }


class _ClaimWatch(ListWatch):
    """Every namespace's claims (`kube.listwatch`), of which the cache keeps this node's, slimmed."""

    def __init__(self, claims: ApiClaims, backoff_max: float) -> None:
        super().__init__(
            "dra-claim-watch",
            "ResourceClaim",
            claims.api,
            CLAIMS,
            page=LIST_PAGE,
            max_page_bytes=MAX_PAGE_BYTES,
            max_event_bytes=MAX_EVENT_BYTES,
            request_timeout=claims.timeout,
            watch_seconds=WATCH_SECONDS,
            silence=claims.silence,  # a silent socket ends the watch
            backoff_max=backoff_max,
        )
        self.claims = claims

    def _page(self, items: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
        # Only this node's claims are kept, slimmed, page by page: the cluster's claims never sit in memory together.
        kept.extend(_slim(c, self.claims.driver) for c in items if self.claims._ours(c))
        del kept[self.claims.max_cached :]

    def _listed(self, kept: list[dict[str, Any]]) -> None:
        self.claims._replace(kept)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self.claims._apply(kind, _slim(obj, self.claims.driver))

    def _failed(self, err: Exception, delay: float) -> None:
        self._errors.log(
            logging.WARNING,
            (type(err), str(err)[:100]),
            "ResourceClaim watch failed (%s); prepare GETs claims meanwhile; retrying in %.1fs",
            self.last_error,
            delay,
        )
        self._errors.flush()
