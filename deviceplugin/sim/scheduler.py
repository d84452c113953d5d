"""The demo's scheduler step: the admission policy refuses an oversized request, the extender skips a fragmented node.

Self-contained: two simulated nodes publish their inventory annotation (the node plugin's own builder), a real
`gpu-share extender` HTTP server (its cache fed directly instead of by watch) answers kube-scheduler's filter and
prioritize calls for a 6-share pod.
"""

from __future__ import annotations

import json
import urllib.request

from prometheus_client import CollectorRegistry

from ..alloc.admission import admission_limits
from ..alloc.plan import build_resources
from ..config.parse import parse_config
from ..config.types import DEFAULT_DOMAIN
from ..extender.cache import ClusterCache
from ..extender.fit import place
from ..extender.http import ExtenderHTTPServer
from ..extender.inputs import pod_request
from ..extender.metrics import ExtenderMetrics
from ..extender.score import Scorer
from ..extender.verbs import Extender
from ..kube.labels import InventoryAnnotation
from ..model.devices import Resource
from ..model.node import Gpu, NodeInfo
from ..model.usage import ContainerShare, Usage


def admission_refusal(
    containers: dict[str, dict[str, int]], limits: dict[str, int], domain: str = DEFAULT_DOMAIN
) -> str | None:
    """What the admission policy (daemonset/admission/policy.yaml) answers for a pod's containers
    ({name: {resource: count}}), None if admitted.

    The same rule and message as the policy's CEL (tests/test_scheduler_manifests.py checks they agree);
    `limits` maps the resource name after `<domain>/` to the largest shares of one unit (the params' data).
    """
    for name, requests in containers.items():
        for key, largest in limits.items():
            count = requests.get(f"{domain}/{key}", 0)
            if count > largest:
                return (
                    f"container {name} asks for {count} {domain}/{key} but no GPU has more than {largest}: one "
                    "container's shares "
                    f"come from one GPU. Ask for at most {largest} {domain}/{key}, or for a whole GPU ({domain}/gpu)"
                )
    return None


def run_scheduler_step(resources: list[Resource], out=print, too_big: tuple[Resource, int] | None = None) -> None:
    """`too_big`: the demo's pod that cannot fit (its resource and count), answered here as the policy would."""
    out("\nWith the scheduler extender and the admission policy (daemonset/extender, daemonset/admission):")
    if too_big is not None and too_big[0].pool.shared:
        resource, count = too_big
        domain = resource.name.split("/", 1)[0]
        limits = {name.split("/", 1)[1]: n for name, n in admission_limits([resource]).items()}
        message = admission_refusal({"server": {resource.name: count}}, limits, domain)
        if message:
            out(f"  too-big ({count} shares) is refused at creation: {message}")
        else:
            out(
                f"  too-big ({count} shares) passes the admission policy ({resource.name} may span GPUs); the "
                "node refuses it"
            )
    domain = resources[0].pool.domain if resources else DEFAULT_DOMAIN  # the demo node's, as the extender's --domain
    share = f"{domain}/gpu-share"
    config = parse_config(
        {
            "version": "v1",
            "domain": domain,
            "pools": [{"name": "inference", "mode": "shared", "resource": "gpu-share", "replicas": 6}],
        }
    )
    cache = ClusterCache()
    # node-a: 3 + 3 free on two GPUs; node-b: GPU 0 full, GPU 1 with 6 free.
    for name, used in (("node-a", (3, 3)), ("node-b", (6, 0))):
        cache.set_node(name, json.dumps(_annotation(name, config, share, used)))
    metrics = ExtenderMetrics(CollectorRegistry(), cache.counts)
    extender = Extender(cache, Scorer("binpack"), lambda r: r.startswith(domain + "/"), metrics)
    server = ExtenderHTTPServer(extender, metrics, lambda: (True, "ready"), port=0, host="127.0.0.1")
    server.start()
    try:
        pod = {
            "metadata": {"name": "six-shares", "namespace": "default", "uid": "demo-six"},
            "spec": {"containers": [{"name": "server", "resources": {"limits": {share: "6"}}}]},
        }
        url = f"http://127.0.0.1:{server.port}"
        result = _post(url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["node-a", "node-b"]})
        out(
            "  Two other simulated nodes, not the one above: node-a and node-b, each two NVIDIA L4s time-sliced "
            "in 6 shares "
            "(node-a: 3 + 3 free, node-b: 0 + 6 free)."
        )
        out(
            "  six-shares (6 shares): kube-scheduler's default check sees 6 free on both nodes; the extender's "
            "filter says:"
        )
        for node, reason in sorted(result["FailedNodes"].items()):
            out(f"    {node}: skipped: {reason}")
        scores = _post(url + "/prioritize", {"Pod": pod, "Nodes": None, "NodeNames": result["NodeNames"]})
        for entry in scores:
            inventory, free = cache.node(entry["Host"], exclude="demo-six")  # without its own reservation
            assert inventory is not None and not isinstance(free, str)  # both nodes were set just above
            (placement,) = place(pod_request(pod, extender.managed), inventory, dict(free)).placements
            gpu = inventory.resources[share].units[placement.unit].gpu
            out(
                f"    {entry['Host']}: fits (score {entry['Score']}/10): bound there, its 6 shares land on "
                f"GPU {gpu}, as the node plugin chooses"
            )
    finally:
        server.stop()


def _annotation(name: str, config, share: str, used: tuple[int, ...]) -> dict:
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-demo{name[-1]}000-0000-4000-8000-00000000000{i}", model="NVIDIA L4", memory_mib=23034)
        for i in range(len(used))
    )
    node = NodeInfo(gpus=gpus, name=name)
    resources = build_resources(config, node)
    shares = tuple(
        ContainerShare(
            "default",
            f"tenant-{i}",
            "main",
            share,
            "inference",
            u.uuid,
            u.uuid,
            tuple(f"{u.uuid}::{k}" for k in range(n)),
            n,
            0,
            True,
        )
        for i, (u, n) in enumerate(zip(resources[0].units, used, strict=True))
        if n
    )
    return InventoryAnnotation().build(node, resources, Usage(shares=shares), frozenset())


def _post(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())
