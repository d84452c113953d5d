"""The DRA driver's front end of `gpu-share run --api dra`, on the node core (`runtime.core`).

The core gives what the device plugin runs on too: the plan, NodeState, the health monitor with the node checks and
its first pass before serving, the node agent (metering, the memory watchdog with its pod Events, the residue guard)
on the usage of prepared claims (`dra.usage`), node labels and the inventory annotation, hot reload, the metrics
endpoint and the stop order. This front end adds its own servers: MPS readiness, the kubelet plugin
(`dra.kubeletplugin`: serve, then register), the claim reader's watch cache, the claims' `status.devices` writer
(`dra.claimstatus`) and the ResourceSlice publisher (`dra.slices`). `stop` removes only this instance's sockets.

Start order: everything a prepare needs (the driver, the claim reader, the kubelet plugin) is built before the
plugin serves and registers, so the kubelet, which calls NodePrepareResources only after registration, is answered
by a driver that can prepare; the slice publisher (its module imported only then) is built and started after it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import defaults
from ..agent.watchdog import host_pid_namespace
from ..config.types import Config, ConfigError
from ..discovery.inventory import Inventory
from ..discovery.mig import MigControl
from ..dra.cdi import CdiWriter
from ..dra.checkpoint import Checkpoint
from ..dra.claims import ApiClaims
from ..dra.kubeletplugin import KubeletPlugin, PluginSettings
from ..dra.lock import LOCK_FILE, SerialLock
from ..dra.migdynamic import MigInstances, MigRescan
from ..dra.prepare import Driver
from ..dra.registration import PluginPaths
from ..dra.shapes import HeldShapes
from ..dra.usage import ClaimUsage
from ..health.evidence import FILE_NAME as EVIDENCE_FILE
from ..health.mpsready import MpsReadiness
from ..kube.client import NodeClient
from ..kube.dranames import driver_name
from ..loop import Clock
from ..model.devices import Resource
from ..model.pods import PodDirectory
from ..obs.drametrics import DraCollector, DraMetrics
from .core import NodeCore, Step
from .options import DaemonOptions
from .plan import ConfigFile, plan_node

if TYPE_CHECKING:
    from ..dra.claimstatus import ClaimStatusWriter
    from ..dra.slices import SlicePublisher

log = logging.getLogger(__name__)

MIG_RESCAN_INTERVAL = 30.0  # seconds between re-reads of the dynamic-MIG GPUs' instances (one NVML list per GPU)


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
    """The DRA driver's front end on the node core: the kubelet plugin, the claim cache, the slice publisher, held
    shapes and MPS readiness; everything else (health with node checks, agent, labels, Events, reload, metrics
    endpoint, the stop order) is the core's, as for the device plugin."""

    def __init__(
        self,
        inventory: Inventory,
        options: DaemonOptions,
        dra: DraOptions,
        api_client: Any,
        start: ConfigFile,
        client: NodeClient | None = None,
        pod_directory: PodDirectory | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`api_client`: the Kubernetes API for claims and slices (None: neither, for tests of the node side);
        `client`: the node's Node and Events (labels, the annotation, the profile label, the watchdog's Events; None:
        none of them); `pod_directory` maps GPU processes to containers (default: `client`; neither: the agent meters
        and reports shares, but attributes no process: no per-container memory, watchdog or residue guard).
        `clock`: what the profile label's interval and the reloader read."""
        node_name = options.node_name  # the Kubernetes node: the driver's pool
        plan = plan_node(
            inventory, start, options.profile, options.profile_label_interval, lambda: client, clock, dynamic_mig=True
        )
        self.inventory, self.options = inventory, options
        self.node, self.config, self.resources = plan.node, plan.config, plan.resources
        self.driver_name = driver_name(self.config.domain)
        self.paths = PluginPaths(dra.registrar_dir, dra.plugins_dir, self.driver_name, dra.instance)
        self.paths.check()
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        self.core = core = NodeCore(inventory, options, plan, self.paths.data_dir / EVIDENCE_FILE, clock)
        self.state, self.monitor, self.registry = core.state, core.monitor, core.registry
        self.mps = MpsReadiness(self.state, core.mps, self.resources, options.timings.watch_interval)
        mig = MigInstances(inventory if isinstance(inventory, MigControl) else None, inventory.processes)
        self.driver = Driver(
            self.driver_name,
            node_name,
            Checkpoint(self.paths.checkpoint),
            CdiWriter(dra.cdi_root, self.driver_name),
            self.state,
            SerialLock(self.paths.data_dir / LOCK_FILE),
            mig,
        )
        self.driver.on_config(self.config, self.resources)
        self.driver.sweep_mig()  # instances of no claim on dynamic-MIG GPUs, from before this start
        self.claims = ApiClaims(api_client, self.driver_name, node_name, cache=dra.claim_cache)
        self.driver.find_claim = self.claims.find  # what a damaged record's claim holds, per the API
        self.metrics = DraMetrics(self.registry)
        self.plugin = KubeletPlugin(self.driver, self.claims, self.state, self.paths, dra.plugin, self.metrics)
        self.api = api_client
        self.writer = (
            f"{time.time_ns()}-{dra.instance or os.getpid()}"  # newer instances (rolling update) win the slices
        )
        self.slices: SlicePublisher | None = None  # built once the plugin is registered (`_serve`)
        self.mig_rescan: MigRescan | None = None  # with the slices: it republishes them
        self.claim_status: ClaimStatusWriter | None = None
        self.shapes = HeldShapes(
            self.driver, self.state, [self.plugin], self.config, self.resources
        )  # held GPUs keep their shape
        self.plugin.after_unprepare = self.shapes.check
        core.operate(
            lambda: self.resources,
            [
                self,
                self.mps,
                self.shapes,
            ],  # this first: a reload that renames the driver is refused before anything changed
            (self._healthz, self._readyz),
            client,
            pod_directory,
            build=ClaimUsage(self.driver.prepared, lambda: self.driver.devices, self.driver_name, node_name),
            kill_check=functools.partial(host_pid_namespace, options.proc_root),
        )
        assert core.agent is not None and core.reloader is not None
        self.agent, self.reloader = core.agent, core.reloader
        self.events, self.publisher, self.metrics_server = core.events, core.publisher, core.metrics_server
        self.registry.register(DraCollector(self.driver, lambda: self.plugin.registered))

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Refuse a reload that renames the driver (a new domain): the kubelet knows it by name, so that needs a
        restart."""
        renamed = driver_name(config.domain)
        if renamed != self.driver_name:
            why = f"changing it renames the DRA driver ({self.driver_name} -> {renamed})"
            raise ConfigError([f"domain: {why}; restart the plugin to apply it"])
        self.config, self.resources = config, resources

    def _healthz(self) -> tuple[bool, str]:
        return (True, "ok") if self.plugin.started else (False, "the DRA sockets are not served")

    def _readyz(self) -> tuple[bool, str]:
        if not self.plugin.registered:
            return False, f"not ready: the kubelet has not registered {self.driver_name}" + (
                f" ({self.plugin.registration.last_error})" if self.plugin.registration.last_error else ""
            )
        if not self.claims.synced:
            return False, "not ready: the ResourceClaim cache has not listed yet"
        return True, "ok"

    def start(self) -> None:
        self.core.start(self._serve)
        log.info(
            "DRA driver %s: %d devices in pool %s", self.driver_name, len(self.driver.devices), self.options.node_name
        )

    def _serve(self) -> None:
        """The core's first health pass, MPS readiness, then the kubelet plugin (serve, register), the claim cache
        and the slices: the first health list and the first slice already mark what is unhealthy."""
        self.core.first_pass()
        self.mps.first_check()  # before registration: an answering MPS daemon's pool takes the first prepare
        self.mps.start()
        if self.api is not None:  # hooked before the first prepare can come
            from ..dra.claimstatus import ClaimStatusWriter

            self.claim_status = ClaimStatusWriter(self.api, self.driver, self.metrics)
            self.plugin.after_prepare = self.claim_status.post
            self.claim_status.start()
        self.plugin.start()
        self.claims.start()
        from ..dra.slices import SlicePublisher  # after registration: prepare never needs it

        slices = SlicePublisher(
            self.api, self.options.node_name, self.driver_name, self.node, self.state, writer=self.writer
        )
        slices.kept_mig = self.driver.mig.kept  # instances the start-up sweep kept are published as taken
        self.registry.register(slices.collector())
        slices.on_config(self.config, self.shapes.add_consumer(slices))
        self.slices = slices
        slices.start()
        self.mig_rescan = MigRescan(
            self.driver.rescan_mig, slices.republish, MIG_RESCAN_INTERVAL
        )  # made behind our back
        self.mig_rescan.start()

    def stop(self) -> None:
        """The core's stop order with this front end's servers; every part stops even when one before it fails (the
        sockets are always removed), and the first failure is raised."""
        servers: list[Step] = [("MIG rescan", self.mig_rescan.stop)] if self.mig_rescan is not None else []
        servers += [("slice publisher", self.slices.stop)] if self.slices is not None else []
        servers += [
            ("kubelet plugin", self.plugin.stop),
            ("claim cache", self.claims.stop),
        ]
        if self.claim_status is not None:
            servers.append(("claim status writer", self.claim_status.stop))
        servers.append(("MPS readiness", self.mps.stop))
        self.core.stop(servers)
