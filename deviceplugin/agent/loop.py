"""The node agent: every interval it observes (agent.observe), enforces — the memory watchdog, the residue guard's
quarantine (agent.residue) written to the NodeState — and meters. Publishing (labels, annotation) is not its job:
agent.publish runs on a thread of its own, so a slow Kubernetes API never delays the watchdog."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..discovery.inventory import Inventory
from ..loop import BackgroundLoop
from ..model.devices import Resource
from ..model.node import MIB, NodeInfo
from ..model.shares import share_gpu_fraction
from ..model.usage import Usage
from ..state import NodeState, NodeView
from . import residue
from .metering import Holding, Meter, MeterKey
from .observe import Observation, Observer
from .procmap import ProcessMapper
from .settings import AgentSettings
from .usage import PodResourcesClient, UsageBuilder, build_usage
from .watchdog import ContainerMemory, MemoryWatchdog

if TYPE_CHECKING:
    from ..config.types import Config

log = logging.getLogger(__name__)


class NodeAgent(BackgroundLoop):
    def __init__(
        self,
        inventory: Inventory,
        node: NodeInfo,
        state: NodeState,
        resources: Callable[[], list[Resource]],
        client: PodResourcesClient,
        settings: AgentSettings = AgentSettings(),
        mapper: ProcessMapper | None = None,
        watchdog: MemoryWatchdog | None = None,
        meter: Meter | None = None,
        build: UsageBuilder = build_usage,
    ) -> None:
        super().__init__("node-agent")
        self.state = state
        self.resources = resources
        self.observer = Observer(inventory, node, client, resources, settings, mapper, build)
        self.watchdog = watchdog or MemoryWatchdog()
        # Rounds further apart than a few intervals (or one rate-limit backoff) are not metered: a gap, not a guess.
        self.meter = meter or Meter(max_gap=max(3 * settings.interval, settings.interval + settings.backoff_max))
        self.quarantine = settings.quarantine  # follows config reloads
        if mapper is None:
            log.warning(
                "no pod directory (Kubernetes API): per-container memory, the watchdog and the residue guard are off"
            )

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """A config reload (runtime.reload): the residue guard quarantines, or not, from the next round on."""
        self.quarantine = config.quarantine

    @property
    def rate_limited(self) -> int:
        """pod-resources calls the kubelet refused by its rate limit."""
        return self.observer.rate_limited

    @property
    def delay(self) -> float:
        """Seconds until the next round: the interval, longer while the kubelet rate-limits."""
        return self.observer.delay

    def start(self) -> None:
        self._start_thread()

    def stop(self) -> None:
        self._stop_thread()
        self.observer.client.close()

    def _run(self) -> None:  # the agent observes; a failed round must never take the plugin down
        self._repeat(self._round, self.observer.settings.interval)

    def _round(self) -> float:
        self.sync()
        return self.delay

    def sync(self) -> NodeView:
        """One round: observe, enforce, meter; returns the node state it leaves."""
        previous = self.state.snapshot()
        before = previous.observation or Observation()
        observation = self.observer.observe(before)
        if observation.attributed:
            self.watchdog.review(list(observation.containers))
        if observation.fresh:
            self.meter.observe(self._holdings(observation.usage, observation.containers))
        gpus = residue.quarantined_gpus(
            observation.residue_mib, before.residue_mib, previous.quarantined_gpus, self.quarantine
        )
        self.state.set_quarantine(
            gpus, residue.quarantined_devices(self.resources(), gpus, observation.usage.allocated())
        )
        self.state.set_observation(observation)
        return self.state.snapshot()

    def _holdings(self, usage: Usage, containers: tuple[ContainerMemory, ...]) -> dict[MeterKey, Holding]:
        """Per (namespace, pod, resource): devices held, the GPU fraction they are, and the memory really used.

        Containers of one pod that share the same devices (one DRA claim) hold them once; their memory adds up.
        """
        units = {(r.name, u.uuid): u for r in self.resources() for u in r.units}
        used = {(c.share.key, c.share.unit_uuid): c.used_mib for c in containers}
        counted: set[tuple[str, str, str, tuple[str, ...]]] = set()
        holdings: dict[MeterKey, Holding] = {}
        for share in usage.shares:
            unit = units.get((share.resource, share.unit_uuid))
            if unit is None:  # changed by a config reload since this round's List
                continue
            key = (share.namespace, share.pod, share.resource)
            held = holdings.get(key, Holding())
            holding = (share.namespace, share.pod, share.unit_uuid, share.devices)
            first = holding not in counted
            counted.add(holding)
            holdings[key] = Holding(
                shares=held.shares + (share.shares if first else 0),
                gpus=held.gpus + (share_gpu_fraction(unit, share.shares) if first else 0.0),
                memory_bytes=held.memory_bytes + used.get((share.key, share.unit_uuid), 0) * MIB,
            )
        return holdings
