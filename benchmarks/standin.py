"""Stand-ins for gpu-share node plugins on a real API server, for the real-scheduler benchmark and the e2e tests.

There is no kubelet: each simulated GPU node is a Node object (capacity and allocatable of CPU, memory, pods and
`example.com/gpu-share`, Ready, untainted) with the inventory annotation, and one thread plays every node's kubelet
and plugin. A pod bound to one of the nodes is admitted as the kubelet would admit it: per container, the devices
the node plugin's GetPreferredAllocation picks (deviceplugin/alloc/placement.py, on the plugin's own Resource, the
node's `allocationPolicy`); a container whose shares fit on no single GPU fails admission, and the pod is marked
Failed with the kubelet's reason `UnexpectedAdmissionError`. The node then republishes its annotation after a
random delay in `republish` seconds (the agent's round and the publisher's debounce), on a second thread.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from dataclasses import dataclass, field

from deviceplugin.alloc.placement import preferred_allocation
from deviceplugin.kube.annotation import ANNOTATION, pod_digest

from .extender_replay import SHARE, annotation, node_resource

MODEL_LABEL = "example.com/gpu.product"  # the stand-in nodes' GPU model, as the node's labeller would publish it


def model_affinity(models: frozenset[str]) -> dict:
    """A pod's node affinity to the nodes whose GPU model is one of `models`."""
    term = {"matchExpressions": [{"key": MODEL_LABEL, "operator": "In", "values": sorted(models)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


log = logging.getLogger(__name__)

ANNOTATION_KEY = f"example.com/{ANNOTATION}"
ADMISSION_ERROR = "UnexpectedAdmissionError"
WATCH_SECONDS = 30


@dataclass(frozen=True)
class GpuNode:
    name: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    max_pods: int = 110
    model: str = ""  # the GPU model, labelled MODEL_LABEL when set (pods that accept some models select it)


@dataclass
class _State:
    node: GpuNode
    used: list[int]
    pods: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # uid -> (unit, shares) per container
    digests: dict[str, str] = field(default_factory=dict)  # uid -> digest


def create_node(
    core, node: GpuNode, labels: dict[str, str], extended: dict[str, str], annotations: dict[str, str] | None = None
) -> None:
    """A Node as a kubelet would register it: capacity = allocatable, Ready, and the not-ready taint removed."""
    meta = {
        "name": node.name,
        "labels": {"kubernetes.io/hostname": node.name, **labels, **({MODEL_LABEL: node.model} if node.model else {})},
        "annotations": annotations or {},
    }
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": meta})
    resources = {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi", "pods": str(node.max_pods), **extended}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(
        node.name,
        {
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "stand-in",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            }
        },
    )
    core.patch_node(node.name, {"spec": {"taints": None}})


class StandInPlugins:
    """The device-plugin path: nodes advertising `example.com/gpu-share`, their kubelets' admission, their
    annotations."""

    def __init__(
        self,
        api_client,
        nodes: list[GpuNode],
        labels: dict[str, str],
        replicas: int = 10,
        policy: str = "fgdstrand",
        republish: tuple[float, float] = (2.0, 5.0),
        seed: int = 0,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.labels = labels
        self.replicas = replicas
        self.policy = policy
        self.republish = republish
        self.rng = random.Random(seed)
        self.nodes = {n.name: _State(n, [0] * n.gpus) for n in nodes}
        self.failures: list[tuple[str, str]] = []  # (pod, message)
        self.admitted = 0
        self._lock = threading.Lock()
        self._due: list[tuple[float, str]] = []  # (when, node) republishes, a heap
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []  # a loop's failures, for the caller to assert on

    def create_nodes(self) -> None:
        for state in self.nodes.values():
            node = state.node
            create_node(
                self.core,
                node,
                self.labels,
                {SHARE: str(node.gpus * self.replicas)},
                {ANNOTATION_KEY: self._annotation(state)},
            )

    def start(self) -> None:
        for target, name in ((self._watch, "standin-watch"), (self._publish, "standin-publish")):
            thread = threading.Thread(target=self._guard, args=(target,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(WATCH_SECONDS + 5)

    def holds(self, uid: str, name: str) -> bool:
        """Has a node admitted pod `uid` (or failed it at admission, `name` in `failures`)?"""
        with self._lock:
            if any(uid in s.pods for s in self.nodes.values()):
                return True
        return any(pod.endswith(f"/{name}") for pod, _ in self.failures)

    def pending_republish(self) -> bool:
        with self._lock:
            return bool(self._due)

    def free(self) -> dict[str, list[int]]:
        with self._lock:
            return {name: [self.replicas - u for u in s.used] for name, s in self.nodes.items()}

    def used_shares(self) -> int:
        with self._lock:
            return sum(sum(s.used) for s in self.nodes.values())

    # --- the two loops ---------------------------------------------------------------------------------
    def _guard(self, target) -> None:
        """A loop that fails is retried after a pause, and the failure is kept: it never dies silently."""
        while not self._stop.is_set():
            try:
                target()
                return
            except Exception as err:  # noqa: BLE001 - recorded and retried
                self.errors.append(f"{target.__name__}: {type(err).__name__}: {err}"[:500])
                log.warning("stand-in %s failed: %s", target.__name__, err)
                self._stop.wait(0.5)

    def _watch(self) -> None:
        from kubernetes import watch

        listed = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=")
        for pod in listed.items:
            self._pod_event("ADDED", pod)
        version = listed.metadata.resource_version
        while not self._stop.is_set():
            stream = watch.Watch()
            for event in stream.stream(
                self.core.list_pod_for_all_namespaces,
                field_selector="spec.nodeName!=",
                resource_version=version,
                timeout_seconds=WATCH_SECONDS,
            ):
                version = event["object"].metadata.resource_version
                self._pod_event(event["type"], event["object"])
                if self._stop.is_set():
                    stream.stop()
                    break

    def _pod_event(self, kind: str, pod) -> None:
        node = pod.spec.node_name
        state = self.nodes.get(node or "")
        if state is None:
            return
        uid = pod.metadata.uid
        with self._lock:
            if kind == "DELETED":
                taken = state.pods.pop(uid, None)
                state.digests.pop(uid, None)
                for unit, shares in taken or ():
                    state.used[unit] -= shares
                if taken:
                    self._schedule(node)
                return
            if uid in state.pods or pod.status.phase in ("Failed", "Succeeded"):
                return
            refusal = self._admit(state, pod)
        if refusal:
            self.failures.append((f"{pod.metadata.namespace}/{pod.metadata.name}", refusal))
            self.core.patch_namespaced_pod_status(
                pod.metadata.name,
                pod.metadata.namespace,
                {
                    "status": {
                        "phase": "Failed",
                        "reason": ADMISSION_ERROR,
                        "message": f"Allocate failed due to {refusal}",
                    }
                },
            )

    def _admit(self, state: _State, pod) -> str:
        """Allocate every container's shares as the kubelet and the node plugin would; '' or the refusal."""
        resource = node_resource(state.node.gpus, self.replicas, self.policy)
        used = list(state.used)
        taken: list[tuple[int, int]] = []
        for container in pod.spec.containers:
            limits = (container.resources.limits or {}) if container.resources else {}
            count = int(limits.get(SHARE, 0) or 0)
            if not count:
                continue
            available = [d.id for d in resource.devices.values() if d.share >= used[d.gpu.index]]
            chosen = preferred_allocation(resource, available, [], count)
            units = {resource.devices[d].gpu.index for d in chosen}
            if len(chosen) < count or len(units) != 1:
                return (
                    f"container {container.name}: {count} shares of {SHARE} do not fit on one GPU "
                    f"(free {[self.replicas - u for u in used]})"
                )
            (unit,) = units
            used[unit] += count
            taken.append((unit, count))
        state.used = used
        state.pods[pod.metadata.uid] = taken
        if taken:
            state.digests[pod.metadata.uid] = pod_digest(pod.metadata.namespace, pod.metadata.name)
            self._schedule(state.node.name)
        self.admitted += 1
        return ""

    def _schedule(self, node: str) -> None:
        if not any(name == node for _, name in self._due):  # already due: that publish carries this change too
            heapq.heappush(self._due, (time.monotonic() + self.rng.uniform(*self.republish), node))
            self._wake.set()

    def _publish(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                wait = self._due[0][0] - time.monotonic() if self._due else WATCH_SECONDS
                due = wait <= 0
                if due:
                    _, name = heapq.heappop(self._due)
                    text = self._annotation(self.nodes[name])
            if due:
                self.core.patch_node(name, {"metadata": {"annotations": {ANNOTATION_KEY: text}}})
                continue
            self._wake.wait(wait)
            self._wake.clear()

    def _annotation(self, state: _State) -> str:
        resource = node_resource(state.node.gpus, self.replicas, self.policy)
        return annotation(resource, state.used, self.policy, sorted(state.digests.values()))


def share_pod_body(
    name: str, shares: int, cpu_milli: int, memory_mib: int, scheduler: str, labels: dict[str, str]
) -> dict:
    """A share pod for the stand-in nodes: one container, pinned to them by node selector."""
    resources: dict = {"requests": {"cpu": f"{cpu_milli}m", "memory": f"{memory_mib}Mi"}}
    if shares:
        resources["limits"] = {SHARE: str(shares)}
        resources["requests"][SHARE] = str(shares)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": labels,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.invalid/none", "resources": resources}],
        },
    }


def scheduler_config(
    name: str,
    extender_url: str | None,
    weight: int = 5,
    strategy: str = "LeastAllocated",
    managed: tuple[str, ...] = (SHARE,),
) -> dict:
    """A KubeSchedulerConfiguration with one profile `name`, NodeResourcesFit's scoring `strategy`, and the extender
    at `extender_url` (None: no extender) for pods asking for one of `managed`."""
    fit = {
        "name": "NodeResourcesFit",
        "args": {
            "scoringStrategy": {
                "type": strategy,
                "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}],
            }
        },
    }
    config: dict = {"profiles": [{"schedulerName": name, "pluginConfig": [fit]}]}
    if extender_url is not None:
        config["extenders"] = [
            {
                "urlPrefix": extender_url,
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "weight": weight,
                "httpTimeout": "5s",
                "nodeCacheCapable": True,
                "ignorable": False,
                "managedResources": [{"name": m, "ignoredByScheduler": False} for m in managed],
            }
        ]
    return config


# --- the DRA path -------------------------------------------------------------------------------------------
DRA_DRIVER = "gpu-share.example.com"  # driver_name("example.com")
DRA_CLASS = "gpu-share-shares"  # daemonset/dra's class of shared devices


def device_class(name: str = DRA_CLASS) -> dict:
    """A DeviceClass of the driver's shared devices (as daemonset/dra's, without the domain replacement)."""
    selector = f"device.driver == '{DRA_DRIVER}' && device.attributes[device.driver].mode in ['time-slicing', 'mps']"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }


def resource_slice(node: GpuNode, replicas: int = 10) -> dict:
    """The node's ResourceSlice as the DRA node plugin publishes it: one shared device per GPU (DraDevice.to_api)."""
    from deviceplugin.dra.devices import dra_devices
    from deviceplugin.model.node import Gpu, NodeInfo

    info = NodeInfo(
        gpus=tuple(
            Gpu(index=i, uuid=f"GPU-dra00000-0000-4000-8000-{i:012d}", model="sim", memory_mib=81920)
            for i in range(node.gpus)
        ),
        name=node.name,
    )
    devices = [d.to_api(DRA_DRIVER, info) for d in dra_devices([node_resource(node.gpus, replicas, "binpack")])]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node.name}-{DRA_DRIVER}"},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node.name,
            "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def share_claim(name: str, shares: int, device_class: str = DRA_CLASS) -> dict:
    """A ResourceClaim asking the class for one device's `shares`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": device_class, "capacity": {"requests": {"shares": str(shares)}}},
                    }
                ]
            }
        },
    }


def claim_pod_body(
    name: str, claim: str, cpu_milli: int, memory_mib: int, scheduler: str, labels: dict[str, str]
) -> dict:
    body = share_pod_body(name, 0, cpu_milli, memory_mib, scheduler, labels)
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    body["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    return body


def every_pod_entry(extender_url: str, weight: int) -> dict:
    """The second extender entry: no managedResources (so kube-scheduler calls it for every pod), the `/all/` verbs
    (DRA claims, and CPU-only pods scored by the GPUs they would strand; share pods answered at once), ignorable (an
    extender outage never blocks other pods)."""
    return {
        "urlPrefix": extender_url + "/all",
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": weight,
        "httpTimeout": "5s",
        "nodeCacheCapable": True,
        "ignorable": True,
    }
