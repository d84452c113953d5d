"""A fake kubelet DRA manager over real gRPC on real Unix sockets, as the v1.36 kubelet behaves (docs/dra.md).

It watches the registration directory; for each new Unix socket it calls GetInfo (1 s deadline), checks the type
and the absolute endpoint, picks the first service of the plugin's own list that it knows (`v1.DRAPlugin`,
`v1beta1.DRAPlugin`; `known` narrows that, to play an older kubelet), answers NotifyRegistrationStatus (5 s),
connects to the endpoint and keeps the plugin's health stream open. `prepare` / `unprepare` send one batched
call per driver with a 45 s deadline and fail as the kubelet does when the answer misses a claim or one claim
has an error. A removed registration socket deregisters the driver.
"""

from __future__ import annotations

import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deviceplugin.api import dra_health_v1alpha1_pb2 as health_pb
from deviceplugin.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from deviceplugin.api import dra_v1_pb2 as v1
from deviceplugin.api import dra_v1_pb2_grpc as v1_grpc
from deviceplugin.api import dra_v1beta1_pb2 as v1beta1
from deviceplugin.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from deviceplugin.api import pluginregistration_v1_pb2 as reg_pb
from deviceplugin.api import pluginregistration_v1_pb2_grpc as reg_grpc

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CALL_TIMEOUT = 45.0


class PrepareError(Exception):
    """What the kubelet would put in the pod's FailedPrepareDynamicResources event."""


@dataclass
class Driver:
    name: str
    endpoint: str
    service: str
    registration_socket: Path
    channel: grpc.Channel
    health: dict[str, tuple[int, str]] = field(default_factory=dict)  # "<pool>/<device>" -> (HealthStatus, message)
    health_messages: int = 0
    health_changed: threading.Condition = field(default_factory=threading.Condition)

    def stub(self) -> Any:
        return (v1_grpc if self.service == "v1.DRAPlugin" else v1beta1_grpc).DRAPluginStub(self.channel)

    @property
    def api(self) -> Any:
        return v1 if self.service == "v1.DRAPlugin" else v1beta1


class FakeDraKubelet:
    def __init__(self, registrar_dir: Path, known: tuple[str, ...] = KUBELET_SERVICES, poll: float = 0.02) -> None:
        self.registrar_dir = registrar_dir
        self.known = known
        self.poll = poll
        self.drivers: dict[str, Driver] = {}
        self.refused: dict[Path, str] = {}
        self.registrations = 0  # successful handshakes so far
        self._seen: dict[Path, tuple[int, int]] = {}  # socket -> (inode, ctime): a recreated socket may reuse the inode
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fake-dra-kubelet", daemon=True)

    def start(self) -> FakeDraKubelet:
        self.registrar_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for driver in list(self.drivers.values()):
            driver.channel.close()

    def wait_registered(self, name: str, timeout: float = 10.0) -> Driver:
        with self._lock:
            if not self._lock.wait_for(lambda: name in self.drivers, timeout):
                raise TimeoutError(f"driver {name} did not register within {timeout:g} s (refused: {self.refused})")
            return self.drivers[name]

    def wait_registrations(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until `count` handshakes have succeeded (a restarted plugin registers again)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.registrations >= count, timeout)

    def wait_deregistered(self, name: str, timeout: float = 10.0) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: name not in self.drivers, timeout)

    def wait_health(self, name: str, predicate: Any, timeout: float = 10.0) -> dict[str, tuple[int, str]]:
        driver = self.wait_registered(name, timeout)
        with driver.health_changed:
            if not driver.health_changed.wait_for(lambda: driver.health and predicate(driver.health), timeout):
                raise TimeoutError(f"health of {name} never matched: {driver.health}")
            return dict(driver.health)

    # --- the DRA manager's calls -------------------------------------------------------------------
    def prepare(self, driver_name: str, claims: list[tuple[str, str, str]]) -> dict[str, list[Any]]:
        """NodePrepareResources for (namespace, name, uid) claims: uid -> devices, or PrepareError."""
        driver = self._driver(driver_name)
        api = driver.api
        request = api.NodePrepareResourcesRequest(
            claims=[api.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
        )
        try:
            response = driver.stub().NodePrepareResources(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            raise PrepareError(f"NodePrepareResources: {err.code()}: {err.details()}") from None
        result: dict[str, list[Any]] = {}
        for uid, entry in response.claims.items():
            if uid not in {u for _, _, u in claims}:
                raise PrepareError(f"NodePrepareResources returned result for unknown claim UID {uid}")
            if entry.error:
                raise PrepareError(f"NodePrepareResources failed for ResourceClaim {uid}: {entry.error}")
            result[uid] = list(entry.devices)
        if len(result) < len({u for _, _, u in claims}):
            raise PrepareError(
                f"NodePrepareResources skipped {len({u for _, _, u in claims}) - len(result)} ResourceClaims"
            )
        return result

    def prepare_errors(self, driver_name: str, claims: list[tuple[str, str, str]]) -> dict[str, str]:
        """The per-claim errors of one NodePrepareResources call (tests look at the messages)."""
        driver = self._driver(driver_name)
        api = driver.api
        response = driver.stub().NodePrepareResources(
            api.NodePrepareResourcesRequest(claims=[api.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]),
            timeout=CALL_TIMEOUT,
        )
        return {uid: entry.error for uid, entry in response.claims.items()}

    def unprepare(self, driver_name: str, claims: list[tuple[str, str, str]]) -> None:
        driver = self._driver(driver_name)
        api = driver.api
        request = api.NodeUnprepareResourcesRequest(
            claims=[api.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
        )
        try:
            response = driver.stub().NodeUnprepareResources(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            raise PrepareError(f"NodeUnprepareResources: {err.code()}: {err.details()}") from None
        for uid, entry in response.claims.items():
            if entry.error:
                raise PrepareError(f"NodeUnprepareResources failed for ResourceClaim {uid}: {entry.error}")
        if len(response.claims) < len({u for _, _, u in claims}):
            raise PrepareError(
                f"NodeUnprepareResources skipped {len({u for _, _, u in claims}) - len(response.claims)} ResourceClaims"
            )

    def _driver(self, name: str) -> Driver:
        with self._lock:
            driver = self.drivers.get(name)
        if driver is None:
            raise PrepareError(f"DRA driver {name} is not registered")
        return driver

    # --- the plugin watcher --------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            current = {}
            for path in self.registrar_dir.iterdir():
                try:
                    st = path.lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(st.st_mode) and not path.name.startswith("."):
                    current[path] = (st.st_ino, st.st_ctime_ns)
            for path in [p for p in self._seen if current.get(p) != self._seen[p]]:
                self._deregister(path)
                del self._seen[path]
            for path, inode in current.items():
                if path not in self._seen:
                    self._seen[path] = inode
                    self._register(path)

    def _register(self, path: Path) -> None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            registration = reg_grpc.RegistrationStub(channel)
            try:
                grpc.channel_ready_future(channel).result(timeout=10)
                info = registration.GetInfo(reg_pb.InfoRequest(), timeout=1)
                service = self._validate(info)
            except (grpc.RpcError, grpc.FutureTimeoutError, ValueError) as err:
                self.refused[path] = str(err)
                try:
                    registration.NotifyRegistrationStatus(
                        reg_pb.RegistrationStatus(plugin_registered=False, error=str(err)), timeout=5
                    )
                except grpc.RpcError:
                    pass
                return
            driver = Driver(info.name, info.endpoint, service, path, grpc.insecure_channel(f"unix://{info.endpoint}"))
            registration.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        with self._lock:
            self.drivers[driver.name] = driver
            self.registrations += 1
            self._lock.notify_all()
        threading.Thread(target=self._health, args=(driver,), name=f"health-{driver.name}", daemon=True).start()

    def _validate(self, info: Any) -> str:
        if info.type != "DRAPlugin":
            raise ValueError(f"no handler registered for plugin type: {info.type}")
        if not info.endpoint.startswith("/"):
            raise ValueError(f"endpoint {info.endpoint} is not absolute")
        if not info.supported_versions:
            raise ValueError("empty list of supported gRPC services")
        for version in info.supported_versions:
            if version in self.known:
                return str(version)
        raise ValueError(
            f"none of services supported by the plugin {list(info.supported_versions)} are supported by the kubelet"
        )

    def _deregister(self, path: Path) -> None:
        with self._lock:
            for name, driver in list(self.drivers.items()):
                if driver.registration_socket == path:
                    del self.drivers[name]
                    driver.channel.close()
            self._lock.notify_all()

    def _health(self, driver: Driver) -> None:
        """The kubelet's health stream: the whole list per message; retried 5 s after it ends, as the kubelet does."""
        while not self._stop.is_set():
            with self._lock:
                if self.drivers.get(driver.name) is not driver:
                    return
            try:
                for message in health_grpc.DRAResourceHealthStub(driver.channel).NodeWatchResources(
                    health_pb.NodeWatchResourcesRequest()
                ):
                    with driver.health_changed:
                        driver.health = {
                            f"{d.device.pool_name}/{d.device.device_name}": (d.health, d.message)
                            for d in message.devices
                        }
                        driver.health_messages += 1
                        driver.health_changed.notify_all()
            except (grpc.RpcError, ValueError):
                pass
            if self._stop.wait(5):
                return
