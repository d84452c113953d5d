"""The shipped DaemonSet (`kubectl kustomize daemonset/`) as a real pod on the real node, made and replaced by the
real kube-controller-manager's DaemonSet controller, updated while pods hold shares.

Three changes to the shipped objects, because this node has neither a registry, a GPU nor kube-proxy: the image is
the node's busybox with this machine's Python, the project and its virtual environment mounted from the host, and
the command runs `gpu-share run` over the fake NVML (two T4s, tests/realnode/fake_nvml_run.py) with the shipped
arguments; the pod uses the host network and is told the API server's loopback address (the in-cluster Service
address needs kube-proxy). Everything else is as shipped: the config and its ConfigMap, RBAC, the node opt-in
labels, volumes, security context, probes and the rolling update strategy. The admission policies are left out
(cluster-wide, and not what this test is about)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from kubernetes import client

from tests.realnode.fake_nvml_run import UUIDS
from tests.support.realnode import RealNode, delete_pod, wait_for

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = (
    f"rn-gpu-share-{uuid.uuid4().hex[:6]}"  # the kustomization's namespace, renamed: a deleted namespace lingers
)
RESOURCE = "example.com/gpu-share"
PROFILE = {"example.com/gpu-share.config": "inference"}  # memoryPerShare 4Gi: 3 shares of each T4
OPT_IN = {"example.com/gpu-share.enabled": "true", "nvidia.com/gpu.present": "true"}
PYTHON_PREFIX = Path(sys.base_prefix)


def shipped(cp: Any) -> list[dict[str, Any]]:
    """The kustomization's objects, the DaemonSet changed as the module docstring says."""
    rendered = subprocess.run(
        [str(cp.bin / "kubectl"), "kustomize", str(ROOT / "daemonset")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o and not o["kind"].startswith("ValidatingAdmissionPolicy")]
    for obj in objects:  # as `namespace:` in an overlay would: the objects, the Namespace, the bindings' subjects
        meta = obj["metadata"]
        if obj["kind"] == "Namespace":
            meta["name"] = NAMESPACE
        elif meta.get("namespace"):
            meta["namespace"] = NAMESPACE
        for subject in obj.get("subjects", []):
            subject["namespace"] = NAMESPACE
    daemonset = next(o for o in objects if o["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    plugin = pod["containers"][0]
    plugin["image"], plugin["imagePullPolicy"] = "local/busybox:1.35", "Never"
    plugin["command"] = [f"{ROOT}/.venv/bin/python", "-m", "tests.realnode.fake_nvml_run", "/tmp/processes.json", "run"]
    plugin["workingDir"] = str(ROOT)
    server = urlparse(cp.server)
    plugin["env"] += [
        {"name": "KUBERNETES_SERVICE_HOST", "value": server.hostname},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(server.port)},
    ]
    mounts = {
        "host-usr": ("/usr", "/usr"),
        "host-lib": ("/usr/lib", "/lib"),
        "host-lib64": ("/usr/lib64", "/lib64"),
        "host-python": (str(PYTHON_PREFIX), str(PYTHON_PREFIX)),
        "project": (str(ROOT), str(ROOT)),
        "tmp": (None, "/tmp"),
    }
    for name, (host, path) in mounts.items():
        pod["volumes"].append(
            {"name": name, **({"hostPath": {"path": host, "type": "Directory"}} if host else {"emptyDir": {}})}
        )
        plugin["volumeMounts"].append({"name": name, "mountPath": path, "readOnly": host is not None})
    return objects


def kubectl(cp: Any, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [str(cp.bin / "kubectl"), f"--kubeconfig={cp.admin_kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class SocketGaps:
    """Polls the kubelet's device-plugins directory every 5 ms and keeps the intervals in which no plugin socket was
    there (the kubelet's own kubelet.sock aside): the time no resource could be registered."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SocketGaps:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        since = None
        while not self._stop.wait(0.005):
            try:
                present = any(p.name != "kubelet.sock" and p.is_socket() for p in self.directory.iterdir())
            except OSError:
                present = False
            if not present and since is None:
                since = time.monotonic()
            elif present and since is not None:
                self.gaps.append(time.monotonic() - since)
                since = None


@pytest.fixture(scope="module")
def core(realnode: RealNode) -> client.CoreV1Api:
    return client.CoreV1Api(realnode.cp.api_client())


@pytest.fixture(scope="module")
def rollout(realnode: RealNode, core: client.CoreV1Api) -> Iterator[str]:
    """The shipped objects applied, with kube-controller-manager and a default kube-scheduler; the node opted in;
    the pods' namespace. Everything removed afterwards (the session's API server is shared)."""
    cp = realnode.cp
    objects = shipped(cp)
    realnode.script("kcm.sh", "start")
    cp.scheduler({}, name="rollout")
    core.patch_node(realnode.name, {"metadata": {"labels": {**OPT_IN, **PROFILE}}})
    ns = f"rn-rollout-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    manifest = yaml.safe_dump_all(objects)
    try:
        kubectl(cp, "apply", "-f", "-", stdin=manifest)
        wait_for(lambda: core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "6", 120)
        yield ns
    finally:
        try:  # the DaemonSet and its pod first, then the rest; the namespaces are not waited for (the namespace
            # controller may have a queue of other tests' namespaces to delete first)
            kubectl(
                cp,
                "delete",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
                "-n",
                NAMESPACE,
                "daemonset",
                "gpu-share",
            )
            wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120)
            kubectl(cp, "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=manifest)
            core.delete_namespace(ns)
            core.patch_node(realnode.name, {"metadata": {"labels": {k: None for k in (*OPT_IN, *PROFILE)}}})
        finally:  # never leave the controller manager running: later tests create what it would make
            cp.stop_process("kube-scheduler#rollout")
            realnode.script("kcm.sh", "stop")


def plugin_pod(core: client.CoreV1Api) -> client.V1Pod | None:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/name=gpu-share").items
    ready = [
        p
        for p in pods
        if p.metadata.deletion_timestamp is None
        and p.status.phase == "Running"
        and all(c.ready for c in p.status.container_statuses or [])
    ]
    return ready[0] if len(ready) == 1 else None


def share_pod(core: client.CoreV1Api, realnode: RealNode, ns: str, name: str, shares: int) -> dict[str, str]:
    """A pod of `shares` shares, running; its GPU environment."""
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name},
            "spec": {
                "nodeName": realnode.name,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "main",
                        "image": "local/busybox:1.35",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env; sleep 3600"],
                        "resources": {"limits": {RESOURCE: str(shares)}},
                    }
                ],
            },
        },
    )

    def printed() -> dict[str, str] | None:
        pod = core.read_namespaced_pod(name, ns)
        assert pod.status.phase not in ("Failed", "Succeeded"), pod.status
        if pod.status.phase != "Running":
            return None
        env = dict(line.split("=", 1) for line in core.read_namespaced_pod_log(name, ns).splitlines() if "=" in line)
        return env if "GPU_SHARE_COUNT" in env else None

    return wait_for(printed, 60)


def test_a_rolling_update_of_the_shipped_daemonset_keeps_running_pods_and_books_nothing_twice(realnode, core, rollout):
    old = wait_for(lambda: plugin_pod(core), 60)
    held = {name: share_pod(core, realnode, rollout, name, shares) for name, shares in (("held-2", 2), ("held-1", 1))}
    apps = client.AppsV1Api(realnode.cp.api_client())
    restarted = {"spec": {"template": {"metadata": {"annotations": {"example.com/restarted-at": str(time.time())}}}}}
    with SocketGaps(realnode.node_dir / "kubelet" / "device-plugins") as sockets:
        apps.patch_namespaced_daemon_set("gpu-share", NAMESPACE, restarted)
        new = wait_for(lambda: (p := plugin_pod(core)) and p.metadata.uid != old.metadata.uid and p, 120)
        wait_for(lambda: core.read_node(realnode.name).status.allocatable.get(RESOURCE) == "6", 60)
    assert len(sockets.gaps) == 1, sockets.gaps  # one gap: the old pod's sockets went, the new pod's came
    print(
        f"\nrolling update: no device plugin socket for {sockets.gaps[0] * 1000:.0f} ms "
        f"(old pod {old.metadata.name} -> new pod {new.metadata.name})"
    )
    for name in held:
        status = core.read_namespaced_pod(name, rollout).status
        assert status.phase == "Running" and status.container_statuses[0].restart_count == 0
    # The new plugin knows what the old one granted: the node's other 3 shares go to pods, each within one GPU,
    # and no GPU ends up with more than its 3 shares.
    after = {
        name: share_pod(core, realnode, rollout, name, shares) for name, shares in (("after-2", 2), ("after-1", 1))
    }
    per_gpu: dict[str, int] = {}
    for env in (*held.values(), *after.values()):
        assert env["NVIDIA_VISIBLE_DEVICES"] in UUIDS  # one GPU per container
        per_gpu[env["NVIDIA_VISIBLE_DEVICES"]] = per_gpu.get(env["NVIDIA_VISIBLE_DEVICES"], 0) + int(
            env["GPU_SHARE_COUNT"]
        )
    assert sorted(per_gpu.values()) == [3, 3], per_gpu
    for name in (*held, *after):
        delete_pod(core, rollout, name)
