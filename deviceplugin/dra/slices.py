"""The slice publisher: keeps the node's ResourceSlices equal to its devices and their taints (docs/dra.md).

Two threads. The publish loop plans the writes (`dra.pool`) from the node's slices of this driver and makes them;
it runs when the config's devices change (`on_config`), when the taints change (a NodeState subscriber), when the
watch sees any change of those slices by someone else (the kubelet wipes a node's slices at its start and 30 s
after the driver's last connection ends; anyone may edit or delete them), and every `resync_interval` as a safety
net. It lists the slices (field selector `spec.driver`, `spec.nodeName`) unless it knows them: after a round it
keeps the slices as its writes left them. The watch thread (`SliceWatch`, a `kube.listwatch` loop) follows the same
slices from a list's resourceVersion, listing again after every stream:
an event showing a slice as the last round wants it (the echo of our own write, typically) updates what is known,
a slice deleted that is not wanted needs nothing; any other event forgets what is known and wakes the loop. So a
taint change is one PUT, a write's echo costs nothing, and a resync round always lists.

Rounds that write are rate-limited by a `dra.writebudget.WriteBudget` (a bucket of `write_burst`, refilled at
`write_rate` per second). A taint change spends one token.

Failures: a 409 (someone wrote in between) is read again and retried at once, `max_conflicts` times in a round;
any other error ends the round and the loop retries after an exponential backoff (`backoff_initial` doubling to
`backoff_max`), logged (repeats summarised) and counted (`stats`, and the `gpushare_dra_*` metrics of
`collector()`). Neither thread ends before `stop()`: every failure is caught, and `stop()` shuts the watch's
socket, so both threads end within a request timeout (at once unless a request is in flight).

Every input is bounded: a response body is read up to `MAX_RESPONSE_BYTES`, a watch event up to `MAX_EVENT_BYTES`,
a list page holds at most `LIST_PAGE` slices (more are deleted page by page, round after round).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..kube.errors import error_line
from ..kube.listwatch import ListWatch
from ..kube.rest import ApiError, RestClient
from ..logs import RepeatLimiter, safe_text
from ..loop import BackgroundLoop
from ..model.node import NodeInfo
from ..state import NodeState, NodeView
from .devices import DraDevice, dra_devices
from .partitions import counter_sets
from .pool import Pool, SliceWrites, Stored, canonical, owner_reference, writer_started
from .taints import device_taints, taint_inputs
from .writebudget import WriteBudget

if TYPE_CHECKING:
    from ..config.types import Config
    from ..model.devices import Resource

log = logging.getLogger(__name__)

RESOURCE_SLICES = "/apis/resource.k8s.io/v1/resourceslices"
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024
LIST_PAGE = 128


class SliceApi:
    """The API calls the publisher makes, as plain JSON (`kube.rest`: every field kept, none dropped)."""

    def __init__(self, api: RestClient | None, node: str, driver: str, timeout: float) -> None:
        self.client = api
        self.node = node
        self.driver = driver
        self.timeout = timeout
        self.selector = f"spec.driver={driver},spec.nodeName={node}"

    @property
    def _api(self) -> RestClient:
        if self.client is None:
            raise ApiError(0, "NoApi", "no Kubernetes API configured")
        return self.client

    def node_uid(self) -> str:
        node = self._api.get(f"/api/v1/nodes/{self.node}", timeout=self.timeout, max_bytes=MAX_RESPONSE_BYTES)
        return str(node["metadata"]["uid"])

    def list(self) -> tuple[list[Stored], str]:
        """One page of this driver's slices on this node, and the list's resourceVersion."""
        found = self._api.list(
            RESOURCE_SLICES,
            field_selector=self.selector,
            limit=LIST_PAGE,
            timeout=self.timeout,
            max_bytes=MAX_RESPONSE_BYTES,
        )
        return [Stored.from_api(item) for item in found.get("items") or []], str(
            found["metadata"].get("resourceVersion", "")
        )

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._api.create(RESOURCE_SLICES, obj, timeout=self.timeout)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._api.replace(f"{RESOURCE_SLICES}/{obj['metadata']['name']}", obj, timeout=self.timeout)

    def delete(self, stored: Stored) -> None:
        """Delete with the UID and resourceVersion read as preconditions; gone already is fine."""
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": stored.uid, "resourceVersion": stored.resource_version},
        }
        try:
            self._api.delete(f"{RESOURCE_SLICES}/{stored.name}", body, timeout=self.timeout)
        except ApiError as err:
            if err.status != 404:
                raise


@dataclass
class PublisherStats:
    """What the publisher did since it started (read by tests, benchmarks and the metrics)."""

    rounds: int = 0  # publish rounds that listed the slices
    writes: dict[str, int] = field(default_factory=lambda: {"create": 0, "update": 0, "delete": 0})
    conflicts: int = 0  # 409s, each read again
    errors: dict[str, int] = field(default_factory=lambda: {"publish": 0, "watch": 0})
    deferred: int = 0  # rounds whose writes waited for the rate limit
    slices: int = 0  # slices of the pool after the last successful round
    generation: int = 0  # the pool's generation after the last successful round
    tainted: int = 0  # devices with a taint in the last published pool
    in_sync: bool = False  # the last round succeeded and nothing changed since
    last_error: str = ""
    superseded_by: str = ""  # a newer instance's writer annotation: this one no longer writes the node's slices


class SlicePublisher(BackgroundLoop):
    """Publishes the node's pool. Call `on_config` (the runtime.reload ConfigConsumer protocol) with the first
    config, `start()`, and `stop()`; nothing is published before the first `on_config`."""

    def __init__(
        self,
        api: RestClient | None,
        node_name: str,
        driver: str,
        node_info: NodeInfo,
        state: NodeState,
        *,
        resync_interval: float = 60.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        request_timeout: float = 10.0,
        watch_timeout: int = 300,
        max_conflicts: int = 5,
        write_burst: int = 20,
        write_rate: float = 2.0,
        writer: str = "",
    ) -> None:
        """`writer`: this instance (`<start ns>-<pod UID or pid>`), stamped on every slice written; a stored slice
        stamped by an instance that started later means a rolling update's newer instance publishes the pool, and
        this one stops writing for good (two writers with different views would rewrite each other's slices)."""
        super().__init__("dra-slices")
        self.writer = writer
        self._started = writer_started(writer) if writer else None
        self.node_name = node_name
        self.driver = driver
        self.node_info = node_info
        self.state = state
        self.resync_interval = resync_interval
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_conflicts = max_conflicts
        self.budget = WriteBudget(write_burst, write_rate)
        self.api = SliceApi(api, node_name, driver, request_timeout)
        self.watch = SliceWatch(self, api, request_timeout, watch_timeout)
        self.kept_mig: Callable[[], Mapping[str, Sequence[tuple[int, int]]]] = (
            dict  # MIG instances of no claim (dra.migdynamic)
        )
        self.stats = PublisherStats()
        self._devices: list[DraDevice] | None = None
        self._owner: dict[str, Any] | None = None
        self._known: dict[str, Stored] | None = None  # the slices as the last round left them; None: list them
        self._aim: tuple[Pool, Mapping[str, Any]] | None = None  # the last round's pool and its specs by name
        self._listed_at = float("-inf")  # monotonic time of the last list
        self._adopted: dict[str, Any] = {}  # slice name -> canonical spec the server kept instead of ours
        self._changes = threading.Condition()
        self._wanted = 0  # grows with every change of what to publish (or of what is stored)
        self._published = 0  # the value of _wanted the last successful round started from
        self._failures = 0  # consecutive failed rounds
        self._retry_at = 0.0  # monotonic time before which a failed loop does not try again
        self._taints_of: tuple[Any, ...] | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._errors = {"publish": RepeatLimiter(log), "watch": RepeatLimiter(log)}  # one per thread

    # --- the interface ----------------------------------------------------------------------------
    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Publish the devices of these resources from now on."""
        devices = dra_devices(resources)
        with self._changes:
            self._devices = devices
        self._changed()

    def start(self) -> None:
        self._unsubscribe = self.state.subscribe(self._state_changed)
        self._taints_of = taint_inputs(self.state.snapshot())
        self._start_thread()
        self.watch.start()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.request_stop()
        self.watch.stop()
        self._stop_thread()
        with self._changes:
            self._changes.notify_all()

    def wait_published(self, timeout: float) -> bool:
        """Wait until a round that started after every change made so far has succeeded; False after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changes:
            target = self._wanted
            while self._published < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._changes.wait(left)
            return True

    def collector(self) -> Collector:
        """Prometheus metrics of this publisher (docs/dra.md#slice-publisher-metrics)."""
        return _SliceCollector(self)

    # --- changes ----------------------------------------------------------------------------------
    def republish(self) -> None:
        """Something `kept_mig` reads changed: publish again."""
        self._changed()

    def _changed(self) -> None:
        with self._changes:
            self._wanted += 1
            self.stats.in_sync = False
        self.nudge()

    def _state_changed(self, view: NodeView) -> None:
        """A NodeState subscriber: new slices only when the taints may differ."""
        inputs = taint_inputs(view)
        if inputs != self._taints_of:
            self._taints_of = inputs
            self._changed()

    # --- the publish loop -------------------------------------------------------------------------
    def _run(self) -> None:
        self._repeat(self._round, self.backoff_max)

    def _round(self) -> float:
        with self._changes:
            devices, wanted = self._devices, self._wanted
        if devices is None:
            return self.resync_interval
        wait = self._retry_at - time.monotonic()
        if wait > 0:  # backing off: a change does not cut the wait short
            return wait
        try:
            deferred = self._publish(devices)
        except Exception as err:
            self._failed("publish", err)
            self._owner = None  # read the Node again: it may be gone, or new (another UID)
            self._forget()
            self._retry_at = time.monotonic() + self._backoff()
            return self._retry_at - time.monotonic()
        self._failures, self._retry_at = 0, 0.0
        if deferred:
            self.stats.deferred += 1
            limiter = self._errors["publish"]
            limiter.log(
                logging.WARNING,
                "rate",
                "DRA slices: writes rate-limited (more than %d rounds in a burst: another writer disagrees?)",
                self.budget.burst,
            )
            limiter.flush()
            return deferred
        with self._changes:
            self._published = max(self._published, wanted)
            self.stats.in_sync = self._published == self._wanted
            self._changes.notify_all()
        return self.resync_interval

    def _backoff(self) -> float:
        self._failures += 1
        return min(self.backoff_max, self.backoff_initial * 2 ** min(self._failures - 1, 30))

    def _failed(self, loop: str, err: Exception) -> None:
        text = error_line(err)
        self.stats.errors[loop] += 1
        self.stats.last_error = text
        limiter = self._errors[loop]
        limiter.log(
            logging.WARNING,
            (type(err), getattr(err, "status", None)),
            "DRA slices (%s) failed, retrying with backoff: %s",
            loop,
            text,
        )
        limiter.flush()

    def _publish(self, devices: list[DraDevice]) -> float:
        """List, plan and write until the stored slices are the pool (a 409 reads again); the seconds to wait when
        writes are due but rate-limited, else 0."""
        owner = self._owner or owner_reference(self.node_name, self.api.node_uid())
        self._owner = owner
        view = self.state.snapshot()
        rendered = []
        for device in devices:
            body = device.to_api(self.driver, self.node_info)
            taints = device_taints(device, view, self.driver)
            if taints:
                body["taints"] = taints
            rendered.append(body)
        gpus = {d.unit.gpu.uuid: d.unit.gpu for d in devices if d.partition}
        pool = Pool(
            self.node_name,
            self.driver,
            owner,
            rendered,
            counter_sets(list(gpus.values()), self.kept_mig()),
            writer=self.writer,
        )
        conflicts = 0
        while True:
            stored = self._stored()
            if self._superseded(stored):
                return 0.0
            writes = pool.writes(stored, self._adopted)
            if writes.count and not conflicts:
                wait = self.budget.take()
                if wait:
                    return wait
            with self._changes:
                self._aim = (pool, writes.desired)
            try:
                written = self._apply(writes)
            except ApiError as err:
                self._forget()
                if err.status != 409 or conflicts == self.max_conflicts:
                    raise
                conflicts += 1
                self.stats.conflicts += 1
                continue
            with self._changes:
                if self._known is not None:  # None: someone else wrote since the list; the next round lists again
                    kept = {s.name: s for s in stored if s.name in writes.desired}
                    self._known = {**kept, **written}
            self.stats.slices = len(writes.desired)
            self.stats.generation = writes.generation
            self.stats.tainted = sum(1 for d in rendered if d.get("taints"))
            return 0.0

    def _superseded(self, stored: list[Stored]) -> bool:
        """Whether a newer instance of this driver wrote one of the node's slices (then stop writing, once said)."""
        if self.stats.superseded_by:
            return True
        if self._started is None:
            return False
        newer = [
            s.writer for s in stored if (started := writer_started(s.writer)) is not None and started > self._started
        ]
        if not newer:
            return False
        self.stats.superseded_by = newer[0]
        log.warning(
            "a newer instance of %s (%s) publishes node %s's ResourceSlices: this one stops writing them",
            self.driver,
            safe_text(newer[0]),
            self.node_name,
        )
        return True

    def _stored(self) -> list[Stored]:
        """The slices as the last round left them, when nothing else changed them since; else as listed now."""
        with self._changes:
            known = self._known
            if known is not None and time.monotonic() - self._listed_at < self.resync_interval:
                return list(known.values())
            self._known = {}  # from this list on, an event that is not an echo of our writes forgets what we know
            self._listed_at = time.monotonic()
        stored, _ = self.api.list()
        self.stats.rounds += 1
        return stored

    def _forget(self) -> None:
        with self._changes:
            self._known = None

    def _apply(self, writes: SliceWrites) -> dict[str, Stored]:
        """Make the writes; the slices written, as the server returned them."""
        written = {}
        for stored in writes.deletes:
            self.api.delete(stored)
            self.stats.writes["delete"] += 1
        for obj in writes.updates:
            written[obj["metadata"]["name"]] = self._adopt(obj, self.api.replace(obj))
            self.stats.writes["update"] += 1
        for obj in writes.creates:
            written[obj["metadata"]["name"]] = self._adopt(obj, self.api.create(obj))
            self.stats.writes["create"] += 1
        if writes.count:
            log.info(
                "DRA slices of node %s: generation %d, %d slices (%d deleted, %d replaced, %d created)",
                self.node_name,
                writes.generation,
                len(writes.desired),
                len(writes.deletes),
                len(writes.updates),
                len(writes.creates),
            )
        return written

    def _adopt(self, sent: dict[str, Any], stored: Mapping[str, Any]) -> Stored:
        """The slice written; remembers when the server kept something else than was sent (a field of a disabled
        feature gate)."""
        name, kept = sent["metadata"]["name"], canonical(stored.get("spec") or {})
        if kept == canonical(sent["spec"]):
            self._adopted.pop(name, None)
        else:
            if name not in self._adopted:
                log.warning(
                    "the API server changed ResourceSlice %s on write (a DRA feature gate off, e.g. "
                    "DRAConsumableCapacity or DRADeviceTaints?): "
                    "publishing what it keeps",
                    safe_text(name),
                )
            self._adopted[name] = kept
        return Stored.from_api(stored)

    # --- what the watch sees ---------------------------------------------------------------------
    def _relisted(self) -> None:
        """The watch listed the slices: events between its previous stream and this list were not seen."""
        self._owner = None  # now and then, read the Node's UID again (a Node deleted and created anew)
        self._forget()
        self._changed()  # look again

    def _watched(self, kind: str, obj: Mapping[str, Any]) -> None:
        """An event: wake the publish loop unless it leaves the slices as the last round wants them."""
        if not self._as_wanted(kind, obj):
            self._forget()
            self._changed()

    def _as_wanted(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """The event leaves the slices as the last round wants them: a wanted slice as wanted (recorded as known), or
        an unwanted one deleted."""
        stored = Stored.from_api(obj)
        with self._changes:
            if self._aim is None:
                return False
            pool, specs = self._aim
            if stored.name not in specs:
                return kind == "DELETED"
            if kind == "DELETED" or not pool.matches(stored, specs[stored.name], self._adopted.get(stored.name)):
                return False
            if self._known is not None:
                self._known[stored.name] = stored
            return True


class SliceWatch(ListWatch):
    """The node's slices of this driver (`kube.listwatch`), listed again after every stream: the version of one
    page is all it needs, the publish loop reads the slices itself."""

    def __init__(self, publisher: SlicePublisher, api: RestClient | None, timeout: float, seconds: int) -> None:
        super().__init__(
            "dra-slices-watch",
            "DRA slices",
            api,
            RESOURCE_SLICES,
            field_selector=publisher.api.selector,
            page=LIST_PAGE,
            max_page_bytes=MAX_RESPONSE_BYTES,
            max_event_bytes=MAX_EVENT_BYTES,
            request_timeout=timeout,
            watch_seconds=seconds,
            backoff_initial=publisher.backoff_initial,
            backoff_max=publisher.backoff_max,
            resume=False,
            list_pages=1,
        )
        self.publisher = publisher

    def _page(self, items: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
        pass  # the list's version is what is needed

    def _listed(self, kept: list[dict[str, Any]]) -> None:
        self.publisher._relisted()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self.publisher._watched(kind, obj)

    def _failed(self, err: Exception, delay: float) -> None:
        self.publisher._failed("watch", err)


class _SliceCollector(Collector):
    def __init__(self, publisher: SlicePublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        stats = self.publisher.stats
        writes = CounterMetricFamily(
            "gpushare_dra_slice_writes",
            "ResourceSlice writes by operation (create, update, delete).",
            labels=["operation"],
        )
        for operation, count in stats.writes.items():
            writes.add_metric([operation], count)
        errors = CounterMetricFamily(
            "gpushare_dra_slice_errors",
            "Failed publish rounds and watch streams (each retried with backoff).",
            labels=["loop"],
        )
        for loop, count in stats.errors.items():
            errors.add_metric([loop], count)
        yield writes
        yield errors
        yield CounterMetricFamily(
            "gpushare_dra_slice_conflicts",
            "409 conflicts on ResourceSlice writes (read again and retried).",
            value=stats.conflicts,
        )
        yield CounterMetricFamily(
            "gpushare_dra_slice_deferred",
            "Publish rounds whose writes waited for the write rate limit.",
            value=stats.deferred,
        )
        yield GaugeMetricFamily(
            "gpushare_dra_slices",
            "ResourceSlices of the node's pool after the last successful round.",
            value=stats.slices,
        )
        yield GaugeMetricFamily(
            "gpushare_dra_pool_generation",
            "The pool's generation after the last successful round.",
            value=stats.generation,
        )
        yield GaugeMetricFamily(
            "gpushare_dra_tainted_devices", "Published devices with at least one taint.", value=stats.tainted
        )
        yield GaugeMetricFamily(
            "gpushare_dra_slices_in_sync",
            "1 when the last round succeeded and nothing changed since.",
            value=int(stats.in_sync),
        )
        yield GaugeMetricFamily(
            "gpushare_dra_slices_superseded",
            "1 when a newer instance of the driver (a rolling update) publishes the node's slices and this one "
            "stopped writing them.",
            value=int(bool(stats.superseded_by)),
        )
