"""`status.devices` of prepared ResourceClaims (KEP-4817, resource.k8s.io/v1 `AllocatedDeviceStatus`): what each
device of this driver gave the claim, for tools to read with `kubectl get resourceclaim -o yaml`.

After a prepare, one entry per prepared device of this driver: `driver`, `pool`, `device`, `shareID` (where the
allocation has one) and `data` (`STATUS_DATA_VERSION`):

    {"uuid": "GPU-…" (the GPU or MIG instance), "gpu": 0 (its GPU's index), "shares": 2, "totalShares": 4,
     "memoryLimitMiB": 7680}

written by server-side apply under the field manager named after the driver, so entries of other drivers on the
same claim are left alone. The write never delays or fails the prepare: claims queue (at most `MAX_QUEUED`, the
oldest dropped and counted), a thread of its own writes them, each at most `MAX_ATTEMPTS` times with a backoff that
doubles from `BACKOFF_INITIAL` to at most `BACKOFF_MAX` seconds; a claim that still fails is logged and counted
(`gpushare_dra_claim_status_writes_total{result}`). A claim gone from the API (404) is not retried. Where the
DRAResourceClaimDeviceStatus feature is off, the API server drops the field: the writes succeed and store nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kube.errors import error_line
from ..kube.rest import ApiError, RestClient
from ..loop import BackgroundLoop
from .checkpoint import PreparedClaim
from .devices import DraDevice

if TYPE_CHECKING:
    from ..obs.drametrics import DraMetrics
    from .prepare import Driver

log = logging.getLogger(__name__)

STATUS_DATA_VERSION = 1  # what `data` holds, as in the module docstring
MAX_QUEUED = 1024  # claims waiting for their status write
MAX_ATTEMPTS = 5
BACKOFF_INITIAL = 0.5  # seconds before the second attempt; doubled each time
BACKOFF_MAX = 10.0  # the longest wait between two attempts
REQUEST_TIMEOUT = 10.0
IDLE_WAIT = 60.0  # seconds the thread sleeps with nothing queued (a post wakes it at once)
FINAL = (400, 403, 409, 422)  # refused for good (bad request, no permission, the claim replaced, invalid): not retried


def device_status(claim: PreparedClaim, devices: dict[str, DraDevice], driver: str) -> list[dict[str, Any]]:
    """The claim's `status.devices` entries of this driver: one per prepared device this config still publishes."""
    entries = []
    for prepared in claim.devices:
        device = devices.get(prepared.device)
        if device is None:  # a reload since: its unit is not known any more
            continue
        data = {
            "version": STATUS_DATA_VERSION,
            "uuid": prepared.mig.uuid if prepared.mig else device.unit.uuid,  # a dynamic-MIG device: the instance made
            "gpu": device.unit.gpu.index,
            "shares": prepared.shares,
            "totalShares": device.shares if device.shared else 1,
            "memoryLimitMiB": prepared.memory_mib,
        }
        entry: dict[str, Any] = {"driver": driver, "pool": prepared.pool, "device": prepared.device, "data": data}
        if prepared.share_id:
            entry["shareID"] = prepared.share_id
        entries.append(entry)
    return entries


@dataclass
class _Pending:
    claim: PreparedClaim
    attempts: int = 0
    due: float = 0.0


class ClaimStatusWriter(BackgroundLoop):
    """See the module docstring. `post` is the kubelet plugin's after-prepare hook: it never blocks nor raises."""

    def __init__(
        self,
        api: RestClient,
        driver: Driver,
        metrics: DraMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__("dra-claim-status")
        self.client = api
        self.driver = driver
        self.metrics = metrics
        self.clock = clock
        self._queue: deque[_Pending] = deque()
        self._lock = threading.Lock()

    def post(self, claims: list[PreparedClaim]) -> None:
        """Queue the status writes of these prepared claims (any thread; returns at once)."""
        with self._lock:
            for claim in claims:
                if len(self._queue) >= MAX_QUEUED:
                    dropped = self._queue.popleft()
                    self._count("dropped")
                    log.warning(
                        "claim status queue full (%d): dropped the status write of claim %s/%s",
                        MAX_QUEUED,
                        dropped.claim.namespace,
                        dropped.claim.name,
                    )
                self._queue.append(_Pending(claim))
        self.nudge()

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        """Stop the thread (after the write in progress, if any); writes still queued are not made."""
        self._stop_thread()

    def _run(self) -> None:
        self._repeat(self._round, IDLE_WAIT)

    def _round(self) -> float:
        """Every write that is due, oldest first; the seconds to the next one due."""
        while not self._stop.is_set():
            wait = self.write_due()
            if wait != 0.0:
                return wait
        return IDLE_WAIT

    def write_due(self) -> float:
        """Make the first write that is due now: 0.0 after one, else the seconds until one is (IDLE_WAIT: none)."""
        now = self.clock()
        with self._lock:
            due = next((p for p in self._queue if p.due <= now), None)
            if due is None:
                return min((p.due - now for p in self._queue), default=IDLE_WAIT)
            self._queue.remove(due)
        self._attempt(due)
        return 0.0

    def _attempt(self, pending: _Pending) -> None:
        claim = pending.claim
        pending.attempts += 1
        try:
            status, why = self._apply(claim)
        except Exception as err:  # connection errors and timeouts are retried as a 5xx is
            status, why = 0, error_line(err)
        if 200 <= status <= 299:
            self._count("ok")
            return
        if status == 404:
            log.info("claim %s/%s is gone from the API: no status to write", claim.namespace, claim.name)
            self._count("gone")
            return
        if pending.attempts >= MAX_ATTEMPTS or status in FINAL:
            self._count("failed")
            log.warning(
                "cannot write status.devices of claim %s/%s (attempt %d of %d): %s",
                claim.namespace,
                claim.name,
                pending.attempts,
                MAX_ATTEMPTS,
                why,
            )
            return
        self._count("retried")
        pending.due = self.clock() + min(BACKOFF_MAX, BACKOFF_INITIAL * 2 ** (pending.attempts - 1))
        with self._lock:
            self._queue.append(pending)

    def _apply(self, claim: PreparedClaim) -> tuple[int, str]:
        """Server-side apply of this driver's entries on /status (the claim's UID a precondition): the HTTP status
        and, for an error, its message; raises when no answer came."""
        devices = {d.name: d for d in self.driver.devices}
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
            "status": {"devices": device_status(claim, devices, self.driver.name)},
        }
        path = f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/{claim.name}/status"
        try:
            self.client.patch(path, body, "apply", field_manager=self.driver.name, force=True, timeout=REQUEST_TIMEOUT)
        except ApiError as err:
            if not err.status:
                raise  # no answer: retried as a 5xx is
            return err.status, error_line(err)
        return 200, ""

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.status_writes.labels(result).inc()
