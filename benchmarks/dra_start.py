"""Start and memory of `gpu-share run --api dra` as a real subprocess, on a real API server (KUBEBUILDER_ASSETS;
skipped without), registered by the suite's fake kubelet DRA manager (tests/support/dra_kubelet.py).

Per start: exec -> registered (the kubelet's GetInfo + NotifyRegistrationStatus done), exec -> the node's
ResourceSlice in the API, then `claims` one-share claims allocated on the node (status.allocation written as the
scheduler would) and prepared one per call as the kubelet does per pod; then the driver's RSS and peak RSS. Floors
beside it, on the same machine: a bare interpreter's exec -> exit, the imports the driver cannot serve without
(grpc + protobuf stubs; its REST client `kube.rest` over urllib3), and, for contrast, the `kubernetes` client package
the node daemons no longer import, each in a fresh interpreter.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from .common import node_file

GPUS, REPLICAS = 8, 16


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for {pid}")


def _floor_ms(code: str, runs: int) -> dict[str, float]:
    """exec -> exit of a fresh interpreter running `code`, and its peak RSS."""
    times, peaks = [], []
    for _ in range(runs):
        started = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", f"{code}\nprint(open('/proc/self/status').read())"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        times.append((time.perf_counter() - started) * 1000)
        peaks.append(next(int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("VmHWM:")) / 1024)
    return {"exec_to_exit_ms_median": round(statistics.median(times), 1), "peak_rss_mib": round(max(peaks), 1)}


def _claim(node: str, driver: str, name: str, device: str, memory_mib: int) -> dict[str, Any]:
    exactly = {"deviceClassName": "gpu-share", "capacity": {"requests": {"shares": "1"}}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": driver,
                            "pool": node,
                            "device": device,
                            "shareID": str(uuid.uuid4()),
                            "consumedCapacity": {"shares": "1", "memory": f"{memory_mib}Mi"},
                        }
                    ]
                }
            }
        },
    }


def _one_start(cp: Any, api: Any, ns: str, node: str, claims: int) -> dict[str, float]:
    from deviceplugin.kube.dranames import driver_name
    from deviceplugin.sim.kubelet import KubeletSimulator
    from tests.support.dra_kubelet import FakeDraKubelet
    from tests.support.kubeobjects import request, slices

    driver = driver_name("example.com")
    root = Path(tempfile.mkdtemp(prefix="gsb-dra-", dir="/tmp"))
    (root / "config.yaml").write_text(
        yaml.safe_dump({"version": "v1", "pools": [{"name": "bench", "mode": "shared", "replicas": REPLICAS}]})
    )
    kubelet = FakeDraKubelet(root / "plugins_registry", poll=0.005).start()
    pods = KubeletSimulator(root / "device-plugins", pod_resources_socket=root / "pod-resources" / "kubelet.sock")
    pods.start()
    args = [
        sys.executable,
        "-m",
        "deviceplugin.cli",
        "run",
        "--api",
        "dra",
        "--node",
        str(node_file(root, GPUS)),
        "--config",
        str(root / "config.yaml"),
        "--kubeconfig",
        str(cp.admin_kubeconfig),
        "--node-name",
        node,
        "--kubelet-root",
        str(root),
        "--cdi-root",
        str(root / "cdi"),
        "--metrics-port",
        "0",
        "--log-level",
        "warning",
        "--pod-resources-socket",
        str(pods.pod_resources_socket),
    ]
    process = None
    try:
        started = time.perf_counter()
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kubelet.wait_registered(driver, timeout=60)
        registered = time.perf_counter() - started
        deadline = time.monotonic() + 60
        while not slices(api, node):
            if time.monotonic() > deadline:
                raise RuntimeError("no ResourceSlice within 60 s")
            time.sleep(0.01)
        published = time.perf_counter() - started
        rss_registered = _status_kib(process.pid, "VmRSS:")
        memory = 81559 // REPLICAS
        prepare_ms = []
        for i in range(claims):
            name = f"c-{uuid.uuid4().hex[:8]}"
            body = _claim(node, driver, name, f"gpu-{i % GPUS}", memory)
            status = body.pop("status")
            created = request(api, "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", body)
            created["status"] = status
            request(api, "PUT", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}/status", created)
            t = time.perf_counter()
            kubelet.prepare(driver, [(ns, name, created["metadata"]["uid"])])
            prepare_ms.append((time.perf_counter() - t) * 1000)
        return {
            "exec_to_registered_ms": registered * 1000,
            "exec_to_slice_ms": published * 1000,
            "rss_registered_mib": rss_registered / 1024,
            "rss_with_claims_mib": _status_kib(process.pid, "VmRSS:") / 1024,
            "peak_rss_mib": _status_kib(process.pid, "VmHWM:") / 1024,
            "prepare_ms": statistics.median(prepare_ms) if prepare_ms else 0.0,
        }
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
        kubelet.stop()
        pods.stop()
        shutil.rmtree(root, ignore_errors=True)
        request(api, "DELETE", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")


def run(smoke: bool = False) -> dict:
    from tests.support.controlplane import ControlPlane, assets_dir

    binaries = assets_dir()
    if binaries is None:
        return {"skipped": "needs KUBEBUILDER_ASSETS (etcd, kube-apiserver)"}
    import urllib3

    from tests.support.kubeobjects import namespace, ready_node, request

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    starts, claims = (1, 10) if smoke else (5, 100)
    cp = ControlPlane.start(binaries)
    try:
        api = cp.api_client()
        ns = namespace(api, "bench-dra")
        rows = []
        for i in range(starts):
            node = f"bench-dra-{i}"
            ready_node(api, node)
            rows.append(_one_start(cp, api, ns, node, claims))
            request(api, "DELETE", f"/api/v1/nodes/{node}")
    finally:
        cp.stop()

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 1)

    return {
        "starts": starts,
        "claims_prepared": claims,
        "gpus": GPUS,
        "shares_per_gpu": REPLICAS,
        **{f"{key}_median": median(key) for key in rows[0]},
        "peak_rss_mib_max": round(max(r["peak_rss_mib"] for r in rows), 1),
        "floors": {
            "bare_interpreter": _floor_ms("pass", 3),
            "import_grpc_and_dra_stubs": _floor_ms("import deviceplugin.api.dra_v1_pb2_grpc", 3),
            "import_kube_rest": _floor_ms("import deviceplugin.kube.rest", 3),
            "import_kubernetes_client_not_loaded": _floor_ms("import kubernetes.client", 3),
        },
        "targets": {"rss_with_100_claims_mib": 60},
    }
