"""The node core of `gpu-share run`: what both front ends run on, built once, in one place.

The device plugin (`runtime.daemon`, PluginManager's servers) and the DRA driver (`runtime.dra`, the kubelet plugin,
the claim cache and the ResourceSlice publisher) add only their own servers to it. The core holds:

- phase one (`NodeCore(...)`, before the Kubernetes client loads): the plan, the one `NodeState`, the metric
  registry, the MPS liveness probe, and the health monitor with the node checks (`DeviceNodeCheck`); `first_pass`
  checks every GPU once, and each front end calls it before its servers list a device;
- phase two (`operate`): the node agent with the memory watchdog and its pod Events (`kube.events`), the node
  labels and inventory annotation (`agent.publish`), hot reload (the front end's consumers first), and the
  `/metrics`, `/healthz`, `/readyz` endpoint with the front end's probes;
- `start` and `stop`, in one order for both (`stop`: the reloader, then the front end's servers, then the loops,
  the endpoint and the inventory; every step runs even when one before it fails, and the first failure is raised).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from ..agent.loop import AgentSettings, NodeAgent
from ..agent.procmap import ProcessMapper
from ..agent.publish import PublishLoop
from ..agent.usage import PodResourcesClient, UsageBuilder, build_usage
from ..agent.watchdog import MemoryWatchdog
from ..alloc.devicenodes import missing_device_nodes, missing_mig_capabilities
from ..config.types import Config
from ..discovery.inventory import Inventory
from ..health.monitor import HealthMonitor
from ..kube.client import NodeClient
from ..kube.events import EventOutbox
from ..kube.labels import NodePublisher
from ..loop import BackgroundLoop, Clock
from ..model.devices import Resource
from ..model.node import Gpu, NodeInfo
from ..model.pods import PodDirectory
from ..mps.control import MpsLiveness
from ..obs.http import MetricsServer
from ..obs.metrics import MetricSources, StateCollector
from ..state import NodeState
from .options import DaemonOptions
from .plan import Plan
from .reload import ConfigConsumer, ConfigReloader

if TYPE_CHECKING:  # the device plugin's manager, for its metrics only: the core imports neither front end's servers
    from ..plugin.manager import PluginManager

log = logging.getLogger(__name__)

Probe = Callable[[], tuple[bool, str]]  # /healthz or /readyz: (ok, why)
Step = tuple[str, Callable[[], None]]  # a named step of the stop order


class DeviceNodeCheck:
    """With deviceSpecs, a GPU whose device nodes are missing on the host, or a MIG instance whose capability nodes
    are, cannot be handed out: Unhealthy (GPU or MIG UUID -> why). Follows reloads (`config` is replaced)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, gpu: Gpu) -> dict[str, str]:
        config = self.config
        if not config.device_specs:
            return {}
        missing = missing_device_nodes(config.device_root, gpu)
        if missing:
            return {
                gpu.uuid: f"deviceSpecs: device node(s) missing under deviceRoot {config.device_root}: "
                f"{', '.join(missing)}"
            }
        return {uuid: f"deviceSpecs: {why}" for uuid, why in missing_mig_capabilities(config.device_root, gpu).items()}


class NodeCore:
    """See the module docstring. Phase one is built here; `operate` builds phase two once the API client exists."""

    def __init__(
        self,
        inventory: Inventory,
        options: DaemonOptions,
        plan: Plan,
        evidence_file: Path,
        clock: Clock = time.monotonic,
    ) -> None:
        """`evidence_file`: where the health monitor keeps reset evidence across restarts (each front end's own
        directory: health.evidence)."""
        self.inventory = inventory
        self.options = options
        self.plan = plan
        self.clock = clock  # what the profile label's interval and the reloader read
        self.node: NodeInfo = plan.node
        self.config: Config = plan.config
        self.node_name = options.node_name or plan.node.name  # the `node` label of every metric
        self.registry = CollectorRegistry()  # every metric of the process; the endpoint serves it from `start`
        self.state = NodeState()  # the node's runtime state: health, quarantine, MPS pools, holds, usage
        self.mps = MpsLiveness(options.mps_control)  # whether an MPS pool's control daemon answers
        self.device_nodes = DeviceNodeCheck(plan.config)
        health = options.health.keeping_evidence_in(evidence_file)
        self.monitor = HealthMonitor(inventory, plan.node, self.state, health, node_check=self.device_nodes)
        self.events: EventOutbox | None = None
        self.agent: NodeAgent | None = None
        self.publisher: PublishLoop | None = None
        self.reloader: ConfigReloader | None = None
        self.metrics_server: MetricsServer | None = None
        self._label_refused = False

    def first_pass(self) -> None:
        """One health pass (NVML queries, device nodes, MIG capabilities) before a front end serves: the first list
        the kubelet gets already marks what is unhealthy, and nothing is handed out before that is known."""
        self.monitor.first_pass()

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload: the device-node check follows its deviceSpecs and deviceRoot."""
        self.config = config
        self.device_nodes.config = config

    def operate(
        self,
        served: Callable[[], list[Resource]],
        consumers: Sequence[ConfigConsumer],
        probes: tuple[Probe, Probe],
        client: NodeClient | None,
        pod_directory: PodDirectory | None = None,
        build: UsageBuilder | None = None,
        manager: PluginManager | None = None,
        cdi_missing: Callable[[], dict[str, list[str]]] | None = None,
        kill_check: Callable[[], str | None] | None = None,
    ) -> None:
        """Phase two, not started. `served`: the resources the front end serves now (they follow reloads);
        `consumers`: the front end's reload consumers, which get a new config first (one may refuse it before
        anything changed); `probes`: its /healthz and /readyz; `client`: the node's API (None: no labels,
        annotation, Events or profile label); `pod_directory` maps GPU processes to containers (default: `client`);
        `build`: the front end's usage map (default: the device plugin's, from pod-resources devices); `kill_check`:
        why the watchdog's `kill` cannot run here (agent.watchdog), where the front end's pod may lack hostPID."""
        options, config = self.options, self.config
        profiles = self.plan.profiles.reading(client)  # the profile label follows reloads from now on
        self._label_refused = self.plan.profile is None and profiles.current(config) is not None
        directory = pod_directory or client
        self.events = EventOutbox(client) if client else None  # the watchdog's Events, posted on a thread of their own
        self.agent = NodeAgent(
            self.inventory,
            self.node,
            self.state,
            served,
            PodResourcesClient(options.pod_resources_socket),
            AgentSettings(options.agent.interval, options.agent.backoff_max, quarantine=config.quarantine),
            mapper=ProcessMapper(directory, options.proc_root) if directory else None,
            watchdog=MemoryWatchdog(
                config.watchdog_policy, events=self.events.post if self.events else None, kill_check=kill_check
            ),
            build=build or build_usage,
        )
        if client is not None:
            publisher = NodePublisher(
                client,
                config.domain,
                options.label_interval,
                config.shared_product_suffix,
                config.deprecated_cuda_labels,
            )
            self.publisher = PublishLoop(publisher, self.state, self.node, served, options.agent.interval)
        ours: list[ConfigConsumer] = [self.agent.watchdog, self.agent, self]
        if self.publisher is not None:
            ours.append(self.publisher)
        self.reloader = ConfigReloader(
            options.config_file,
            self.node,
            profiles,
            options.reload_interval,
            [*consumers, *ours],
            self.clock,
            dynamic_mig=self.plan.dynamic_mig,  # a reload builds the pools the plan was built for
        )
        sources = MetricSources(
            self.node, self.state, manager, self.agent, self.reloader, cdi_missing=cdi_missing, events=self.events
        )
        self.registry.register(StateCollector(sources))
        if options.metrics_port:
            self.metrics_server = MetricsServer(
                self.registry, probes[0], probes[1], options.metrics_port, options.metrics_host, node=self.node_name
            )

    def start(self, serve: Callable[[], None]) -> None:
        """The endpoint, then `serve` (the front end's first pass and servers), then the loops; `operate` first."""
        assert self.agent is not None and self.reloader is not None, "NodeCore.operate first"
        if self.config.device_specs:
            missing = sorted({p for gpu in self.node.gpus for p in missing_device_nodes(self.config.device_root, gpu)})
            if missing:
                log.warning(
                    "deviceSpecs: device nodes not found: %s; the GPUs that need them are Unhealthy until they exist",
                    ", ".join(missing),
                )
        if self.metrics_server:
            self.metrics_server.start()
        serve()
        self.monitor.start()
        self.reloader.start(self.config, self.plan.digest, self._label_refused)  # the config the plan already parsed
        if self.events:
            self.events.start()
        self.agent.start()
        if self.publisher:
            self.publisher.start()

    def stop(self, servers: Sequence[Step]) -> None:
        """The reloader first (a round in progress may apply a config to the servers), then the front end's
        `servers` (their sockets go, and the kubelet marks the devices gone at once). The loops were all asked to end
        before, so their last rounds end side by side while the servers stop. Every step runs even when one before it
        fails; the first failure is raised. Each step's time is logged at debug level."""
        loops: list[BackgroundLoop] = [
            p for p in (self.publisher, self.agent, self.events, self.monitor) if p is not None
        ]
        for loop in loops:
            loop.request_stop()
        steps: list[Step] = [("config reloader", self.reloader.stop)] if self.reloader else []
        steps += [*servers, *((loop.name, loop.stop) for loop in loops)]
        if self.metrics_server:
            steps.append(("metrics endpoint", self.metrics_server.stop))
        steps.append(("inventory", self.inventory.close))
        failed: BaseException | None = None
        for name, step in steps:
            started = time.perf_counter()
            try:
                step()
            except Exception as err:
                log.exception("stop: %s failed", name)
                failed = failed or err
            log.debug("stop: %s in %.1f ms", name, (time.perf_counter() - started) * 1000)
        if failed:
            raise failed
