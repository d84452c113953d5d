"""Extender test helpers: an inventory annotation, a Pod object, ExtenderArgs, an Extender on a fresh cache."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from deviceplugin.extender.cache import ClusterCache
from deviceplugin.extender.metrics import ExtenderMetrics
from deviceplugin.extender.score import Scorer
from deviceplugin.extender.verbs import Extender

SHARE = "example.com/gpu-share"


def managed(name: str) -> bool:
    return name.startswith("example.com/")


def annotation(
    *units: tuple,
    resource: str = SHARE,
    pods: tuple[str, ...] = (),
    span: bool = False,
    policy: str = "binpack",
    generation: int = 1,
) -> str:
    """units: (total, used) or (total, used, health) or (total, used, health, profile)."""
    entries = []
    for i, unit in enumerate(units):
        total, used, *rest = unit
        health, profile = (rest + ["Healthy", ""][len(rest) :])[:2]
        entry = {
            "uuid": f"{'MIG' if profile else 'GPU'}-{i}",
            "gpu": i,
            "total": total,
            "used": used,
            "free": total - used if health == "Healthy" else 0,
            "health": health,
        }
        if profile:
            entry["profile"] = profile
        entries.append(entry)
    return json.dumps(
        {
            "version": 2,
            "generation": generation,
            "gpus": [],
            "pods": list(pods),
            "resources": {
                resource: {"pool": "shared", "allowSpanGPUs": span, "allocationPolicy": policy, "units": entries}
            },
        }
    )


def pod(
    name: str,
    *containers: dict,
    uid: str | None = None,
    node: str = "",
    nominated: str = "",
    init: tuple[dict, ...] = (),
) -> dict:
    def spec(i: int, requests: dict) -> dict:
        return {"name": f"c{i}", "resources": {"limits": {k: str(v) for k, v in requests.items()}}}

    body = {
        "metadata": {"name": name, "namespace": "team", "uid": uid or f"uid-{name}"},
        "spec": {
            "containers": [spec(i, c) for i, c in enumerate(containers)],
            "initContainers": [spec(9, c) for c in init],
        },
        "status": {"phase": "Pending"},
    }
    if node:
        body["spec"]["nodeName"] = node
    if nominated:
        body["status"]["nominatedNodeName"] = nominated
    return body


def args(p: dict, *names: str) -> dict:
    return {"Pod": p, "Nodes": None, "NodeNames": list(names)}


def extender(nodes: dict[str, str], **cache_kw) -> Extender:
    cache = ClusterCache(**cache_kw)
    for name, text in nodes.items():
        cache.set_node(name, text)
    return Extender(cache, Scorer("binpack"), managed, ExtenderMetrics(CollectorRegistry(), cache.counts))


def host_pod(name: str, cpu: str, memory: str = "1Gi", node: str = "", shares: int = 0) -> dict:
    body = pod(name, {SHARE: shares} if shares else {}, node=node)
    body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu, "memory": memory}
    return body
