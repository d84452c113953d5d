"""DRA slices on a real API server (KUBEBUILDER_ASSETS: etcd + kube-apiserver; skipped without): the pool of the
8xA100-80GB-mig node (examples/config/mig-mixed.yaml) published after the publisher starts, an XID's taint written
and visible in the API (once the publisher is steady: its watch running), and the slices back after the kubelet's
wipe."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = "gpu-share.example.com"


def _ms(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"median_ms": round(statistics.median(ms), 1), "max_ms": round(max(ms), 1)}


def _visible(api, node: str, predicate, timeout: float = 5.0) -> float:
    """Seconds until a GET of the node's slices satisfies `predicate` (polled every 2 ms)."""
    from tests.support.kubeobjects import slices

    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if predicate(slices(api, node)):
            return time.perf_counter() - started
        time.sleep(0.002)
    raise RuntimeError(f"not visible within {timeout} s")


def run(smoke: bool = False) -> dict:
    from tests.support.controlplane import ControlPlane, assets_dir

    binaries = assets_dir()
    if binaries is None:
        return {"skipped": "needs KUBEBUILDER_ASSETS (etcd, kube-apiserver)"}
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    from deviceplugin.alloc.plan import build_resources
    from deviceplugin.config.parse import parse_config_text
    from deviceplugin.discovery.simulated import SimulatedInventory
    from deviceplugin.dra.slices import SlicePublisher
    from deviceplugin.state import NodeState
    from tests.support.kubeobjects import ready_node, request

    info = SimulatedInventory.from_file(ROOT / "examples" / "nodes" / "8xA100-80GB-mig.yaml").discover()
    config = parse_config_text((ROOT / "examples" / "config" / "mig-mixed.yaml").read_text(), "mig-mixed.yaml")
    resources = build_resources(config, info)
    rounds = 3 if smoke else 20
    cp = ControlPlane.start(binaries)
    publish, taint_published, taint_visible, wipe = [], [], [], []
    devices = 0
    try:
        api = cp.api_client()
        for i in range(rounds):
            name = f"bench-{i}"
            ready_node(api, name)
            state = NodeState()
            publisher = SlicePublisher(
                cp.rest_client(), name, DRIVER, info, state, backoff_initial=0.02, backoff_max=0.5
            )
            started = time.perf_counter()
            publisher.on_config(config, resources)
            publisher.start()
            if not publisher.wait_published(10):
                raise RuntimeError(f"not published: {publisher.stats.last_error}")
            publish.append(time.perf_counter() - started)
            devices = sum(
                len(s["spec"].get("devices", []))
                for s in request(
                    api,
                    "GET",
                    "/apis/resource.k8s.io/v1/resourceslices",
                    query=[("fieldSelector", f"spec.nodeName={name}")],
                )["items"]
            )
            while publisher.watch.streams < 1:  # steady state: the watch has had its first look
                time.sleep(0.005)
            publisher.wait_published(5)
            gpu = info.gpus[i % len(info.gpus)]
            started = time.perf_counter()
            state.set_health({gpu.uuid: "XID 79"}, frozenset({gpu.uuid}))
            publisher.wait_published(5)
            taint_published.append(time.perf_counter() - started)
            taint_visible.append(
                time.perf_counter()
                - started
                + _visible(
                    api, name, lambda found: any(d.get("taints") for s in found for d in s["spec"].get("devices", []))
                )
            )
            started = time.perf_counter()
            request(
                api,
                "DELETE",
                "/apis/resource.k8s.io/v1/resourceslices",
                query=[("fieldSelector", f"spec.nodeName={name}")],
            )
            _visible(api, name, lambda found: len(found) == 1)
            wipe.append(time.perf_counter() - started)
            publisher.stop()
    finally:
        cp.stop()
    return {
        "node": "8xA100-80GB-mig, mig-mixed.yaml",
        "devices": devices,
        "rounds": rounds,
        "start_to_published": _ms(publish),
        "xid_to_taint_written": _ms(taint_published),
        "xid_to_taint_visible": _ms(taint_visible),
        "wipe_to_republished": _ms(wipe),
    }
