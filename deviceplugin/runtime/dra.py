"""The composition root of `gpu-share run --api dra`: the DRA driver on a node.

Config plan and discovery (`runtime.plan`), NodeState with the health monitor and MPS readiness, the kubelet plugin (`dra.kubeletplugin`:
serve, then register), the claim reader's watch cache, the ResourceSlice publisher (`dra.slices`), the node agent
(agent.loop: metering, the memory watchdog, the residue guard) on the usage of prepared claims (`dra.usage`), metrics
with `/healthz` and `/readyz`, and hot reload fanning out to all of them. `stop` undoes `start` in reverse order and
removes only this instance's sockets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from .. import defaults
from ..agent.loop import AgentSettings, NodeAgent
from ..agent.procmap import ProcessMapper
from ..agent.usage import PodResourcesClient
from ..agent.watchdog import MemoryWatchdog
from ..config.types import Config, ConfigError
from ..discovery.inventory import Inventory
from ..discovery.mig import MigControl
from ..dra.cdi import CdiWriter
from ..dra.checkpoint import Checkpoint
from ..dra.claims import ApiClaims
from ..dra.devices import driver_name
from ..dra.kubeletplugin import KubeletPlugin, PluginSettings
from ..dra.lock import LOCK_FILE, SerialLock
from ..dra.migdynamic import MigInstances
from ..dra.mpsready import MpsReadiness
from ..dra.prepare import Driver
from ..dra.registration import PluginPaths
from ..dra.shapes import HeldShapes
from ..dra.slices import SlicePublisher
from ..dra.usage import ClaimUsage
from ..health.monitor import HealthMonitor
from ..kube.client import NodeClient
from ..loop import Clock
from ..model.devices import Resource
from ..model.pods import PodDirectory
from ..mps.control import MpsLiveness
from ..obs.drametrics import DraCollector, DraMetrics
from ..obs.metrics import MetricSources, StateCollector
from ..state import NodeState
from .daemon import metrics_endpoint
from .options import DaemonOptions
from .plan import ConfigFile, plan_node
from .reload import ConfigConsumer, ConfigReloader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraOptions:
    """The DRA driver's settings beside `DaemonOptions` (whose node_name is the Kubernetes node: the pool)."""

    registrar_dir: Path = Path(defaults.KUBELET_ROOT) / "plugins_registry"
    plugins_dir: Path = Path(defaults.KUBELET_ROOT) / "plugins"
    cdi_root: Path = Path(defaults.DRA_CDI_ROOT)
    instance: str = ""  # the pod UID for rolling-update socket names; "" for the plain names
    claim_cache: bool = True
    plugin: PluginSettings = PluginSettings()


class DraDaemon:
    def __init__(
        self,
        inventory: Inventory,
        options: DaemonOptions,
        dra: DraOptions,
        api_client: Any,
        start: ConfigFile,
        kubeconfig: str | None = None,
        pod_directory: PodDirectory | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """Without `pod_directory` the agent meters and reports shares, but attributes no process: no per-container
        memory, watchdog or residue guard. `clock`: what the profile label's interval and the reloader read."""
        self.inventory = inventory
        self.options = options
        node_name = options.node_name
        plan = plan_node(
            inventory, start, options.profile, options.profile_label_interval, lambda: NodeClient.connect(node_name, kubeconfig), clock, dynamic_mig=True
        )
        self.node, self.config, self.resources = plan.node, plan.config, plan.resources
        self._digest = plan.digest
        self.driver_name = driver_name(self.config.domain)
        self.state = NodeState()
        self.monitor = HealthMonitor(inventory, self.node, self.state, options.health)
        self.mps = MpsReadiness(self.state, MpsLiveness(options.mps_control), self.resources, options.timings.watch_interval)
        self.paths = PluginPaths(dra.registrar_dir, dra.plugins_dir, self.driver_name, dra.instance)
        self.paths.check()
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        mig = MigInstances(inventory if isinstance(inventory, MigControl) else None, inventory.processes)
        self.driver = Driver(
            self.driver_name, node_name, Checkpoint(self.paths.checkpoint), CdiWriter(dra.cdi_root, self.driver_name), self.state,
            SerialLock(self.paths.data_dir / LOCK_FILE), mig,
        )
        self.driver.on_config(self.config, self.resources)
        self.driver.sweep_mig()  # instances of no claim on dynamic-MIG GPUs, from before this start
        self.claims = ApiClaims(api_client, self.driver_name, node_name, cache=dra.claim_cache)
        self.driver.find_claim = self.claims.find  # what a damaged record's claim holds, per the API
        self.registry = CollectorRegistry()
        self.metrics = DraMetrics(self.registry)
        self.plugin = KubeletPlugin(self.driver, self.claims, self.state, self.paths, dra.plugin, self.metrics)
        self.slices = SlicePublisher(api_client, node_name, self.driver_name, self.node, self.state)
        self.slices.kept_mig = self.driver.mig.kept  # instances the start-up sweep kept are published as taken
        self.agent = NodeAgent(
            inventory,
            self.node,
            self.state,
            lambda: self.resources,
            PodResourcesClient(options.pod_resources_socket),
            AgentSettings(options.agent.interval, options.agent.backoff_max, quarantine=self.config.quarantine),
            mapper=ProcessMapper(pod_directory, options.proc_root) if pod_directory else None,
            watchdog=MemoryWatchdog(self.config.watchdog_policy),
            build=ClaimUsage(self.driver.prepared, lambda: self.driver.devices, self.driver_name, node_name),
        )
        self.shapes = HeldShapes(self.driver, self.state, [self.plugin, self.slices], self.config, self.resources)  # held GPUs keep their shape
        self.plugin.after_unprepare = self.shapes.check
        consumers: list[ConfigConsumer] = [self, self.mps, self.shapes, self.agent.watchdog, self.agent]
        self.reloader = ConfigReloader(options.config_file, self.node, plan.profiles, options.reload_interval, consumers, clock, dynamic_mig=True)
        self.registry.register(DraCollector(self.driver, lambda: self.plugin.registered))
        self.registry.register(self.slices.collector())
        self.registry.register(StateCollector(MetricSources(self.node, self.state, agent=self.agent, reloader=self.reloader)))
        self.metrics_server = metrics_endpoint(options, self.registry, self._healthz, self._readyz, node_name)

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Refuse a reload that renames the driver (a new domain): the kubelet knows it by name, so that needs a restart."""
        if driver_name(config.domain) != self.driver_name:
            raise ConfigError([f"domain: changing it renames the DRA driver ({self.driver_name} -> {driver_name(config.domain)}); restart the plugin to apply it"])
        self.config, self.resources = config, resources

    def _healthz(self) -> tuple[bool, str]:
        return (True, "ok") if self.plugin.started else (False, "the DRA sockets are not served")

    def _readyz(self) -> tuple[bool, str]:
        if not self.plugin.registered:
            return False, f"not ready: the kubelet has not registered {self.driver_name}" + (f" ({self.plugin.registration.last_error})" if self.plugin.registration.last_error else "")
        if not self.claims.synced:
            return False, "not ready: the ResourceClaim cache has not listed yet"
        return True, "ok"

    def start(self) -> None:
        if self.metrics_server:
            self.metrics_server.start()
        self.monitor.start()
        self.mps.start()
        self.plugin.start()
        self.claims.start()
        self.slices.on_config(self.config, self.shapes.served)
        self.slices.start()
        self.agent.start()
        self.reloader.start(self.config, self._digest)
        log.info("DRA driver %s: %d devices in pool %s", self.driver_name, len(self.driver.devices), self.options.node_name)

    def stop(self) -> None:
        """Every part stops even when one before it fails (the sockets are always removed); the first failure is raised.
        The agent and health loops are asked to end first, so their last waits pass while the rest stops; each step's
        time is logged at debug level."""
        for loop in (self.agent, self.monitor):
            loop.request_stop()
        parts: list[tuple[str, Callable[[], None]]] = [
            ("config reloader", self.reloader.stop), ("node agent", self.agent.stop), ("slice publisher", self.slices.stop),
            ("kubelet plugin", self.plugin.stop), ("claim cache", self.claims.stop), ("MPS readiness", self.mps.stop), ("health monitor", self.monitor.stop),
        ]
        if self.metrics_server:
            parts.append(("metrics endpoint", self.metrics_server.stop))
        parts.append(("inventory", self.inventory.close))
        failed: Exception | None = None
        for name, stop in parts:
            started = time.perf_counter()
            try:
                stop()
            except Exception as err:
                log.exception("stopping the DRA driver: %s failed", name)
                failed = failed or err
            log.debug("stop: %s in %.1f ms", name, (time.perf_counter() - started) * 1000)
        if failed:
            raise failed

