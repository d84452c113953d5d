"""A real node for tests: kubelet v1.36 + containerd + runc in their own mount namespace, against the session's
API server (tests/support/controlplane.py).

The node's scripts (`up.sh`, `down.sh`, `nsexec.sh`, `restart.sh`, `kcm.sh`) live in the directory `REALNODE_DIR`
names (`.ci/run` sets it); without it, or on a machine that cannot run a node, the tests are skipped with the
check that failed. One node per test session, named after the machine (the API server reaches the kubelet by
hostname, which must resolve to loopback); `stop()` stops what `nsexec()` started, then the node, then deletes the
Node object.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.support.controlplane import ControlPlane, _free_port


def scripts_dir() -> Path | None:
    value = os.environ.get("REALNODE_DIR", "")
    return Path(value) if value and (Path(value) / "up.sh").is_file() else None


def cannot_run() -> str | None:
    """Why this machine cannot start the node (the first failed check), or None."""
    if os.geteuid() != 0:
        return "not root (the kubelet, containerd and runc need root)"
    for tool in ("unshare", "nsenter", "openssl", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    if not Path("/sys/fs/cgroup").is_dir() or not any(Path("/sys/fs/cgroup").iterdir()):
        return "no cgroup filesystem at /sys/fs/cgroup"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --mount fails: {probe.stderr.strip()}"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError as err:
        return f"the hostname {socket.gethostname()!r} does not resolve ({err})"
    if not address.startswith("127."):
        return (
            f"the hostname {socket.gethostname()!r} resolves to {address}, not loopback (kubectl logs/exec "
            "reach the kubelet by it)"
        )
    if Path("/var/lib/kubelet/pods").exists() and any(Path("/var/lib/kubelet/pods").iterdir()):
        return "a kubelet already runs on this machine (/var/lib/kubelet/pods is not empty)"
    return None


@dataclass
class RealNode:
    scripts: Path
    cp: ControlPlane
    work: Path
    name: str = ""
    kubelet_port: int = 0
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def node_dir(self) -> Path:
        return self.work / "node"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "NODE_DIR": str(self.node_dir),
            "CP_RUN": str(self.work / "cp"),
            "PATH": f"{self.cp.bin}:{os.environ.get('PATH', '')}",
            "KUBECONFIG": str(self.cp.admin_kubeconfig),
        }

    @classmethod
    def start(cls, scripts: Path, cp: ControlPlane) -> RealNode:
        node = cls(
            scripts=scripts, cp=cp, work=Path(tempfile.mkdtemp(prefix="gs-rn-")), name=socket.gethostname().lower()
        )
        try:
            node._up()
        except BaseException:
            node.stop()
            raise
        return node

    def _up(self) -> None:
        # up.sh takes the control plane as shared/controlplane/up.sh leaves it: $CP_RUN/pki/ca.{crt,key} and env
        run = self.work / "cp"
        (run / "pki").mkdir(parents=True)
        for name in ("ca.crt", "ca.key"):
            shutil.copy(self.cp.work / "pki" / name, run / "pki" / name)
        shutil.copy(self.cp.work / "sa.key", run / "pki" / "sa.key")  # kcm.sh signs service-account tokens with it
        (run / "env").write_text(
            f'export CP_SERVER="{self.cp.server}"\nexport KUBECONFIG="{self.cp.admin_kubeconfig}"\n'
        )
        self.kubelet_port = _free_port()
        env = {**self.env, "KUBELET_PORT": str(self.kubelet_port), "KUBELET_HEALTHZ_PORT": str(_free_port())}
        done = subprocess.run([str(self.scripts / "up.sh")], env=env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"up.sh exited {done.returncode}: {done.stdout[-3000:]}{done.stderr[-3000:]}")
        if f"node {self.name} Ready=True" not in done.stdout:  # up.sh waits for Ready, then says what it saw
            log = (self.node_dir / "logs" / "kubelet.log").read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"the node did not become Ready: {done.stdout[-1500:]}\nkubelet.log:\n" + "\n".join(log))
        # no node-lifecycle controller (kcm.sh is not run): remove the not-ready taint the API server put on the
        # new Node
        subprocess.run(
            ["kubectl", "taint", "node", self.name, "node.kubernetes.io/not-ready:NoSchedule-"],
            env=self.env,
            capture_output=True,
            timeout=30,
        )

    def nsexec(self, *argv: str, log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start a process in the node's mount namespace (where the kubelet's sockets and /var/run/cdi are), with
        NODE_NAME set as the DaemonSet sets it (and `env` added)."""
        out = open(log or os.devnull, "ab")
        proc = subprocess.Popen(
            [str(self.scripts / "nsexec.sh"), *argv],
            env={**self.env, "NODE_NAME": self.name, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.started.append(proc)
        return proc

    def script(self, *argv: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(self.scripts / argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    def kubelet_pid(self) -> int:
        return int((self.node_dir / "pids" / "kubelet.pid").read_text())

    def stop_process(self, proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop(self) -> None:
        for proc in self.started:
            self.stop_process(proc)
        if (self.node_dir / "pids").is_dir():
            subprocess.run([str(self.scripts / "down.sh"), "--wipe"], env=self.env, capture_output=True, timeout=120)
            subprocess.run(
                ["kubectl", "delete", "node", self.name, "--ignore-not-found", "--wait=false"],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
        if (self.scripts / "kcm.sh").is_file() and (self.work / "cp" / "pids").is_dir():
            subprocess.run([str(self.scripts / "kcm.sh"), "stop"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.work, ignore_errors=True)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll until `predicate()` is truthy; its value (raises TimeoutError naming the wait)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true after {timeout:g} s: {getattr(predicate, '__name__', predicate)}")
        time.sleep(interval)


def delete_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Delete the pod (if it is still there) and wait until it is gone."""
    try:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except client.ApiException as err:
        if err.status != 404:
            raise

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, namespace)
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, 60)


@contextmanager
def dra_cluster(node: RealNode, scheduler: str, prefix: str) -> Iterator[str]:
    """The shipped DeviceClasses (those not there yet), a kube-scheduler of profile `scheduler` and a namespace
    `<prefix>-<random>` for a module's DRA tests; yields the namespace. On the way out the scheduler is stopped and
    the DeviceClasses it created are deleted (the session API server is shared: the chart's tests install classes of
    these names)."""
    import uuid

    import yaml

    from tests.support.kubeobjects import request

    root = Path(__file__).resolve().parents[2]
    api: Any = node.cp.api_client()
    created = []
    try:
        for document in yaml.safe_load_all((root / "daemonset" / "dra" / "02-deviceclasses.yaml").read_text()):
            try:
                request(api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", document)
                created.append(document["metadata"]["name"])
            except client.ApiException as err:
                assert err.status == 409, err
        node.cp.scheduler({"profiles": [{"schedulerName": scheduler}]}, name=scheduler)
        ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": ns}})
        core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
        yield ns
    finally:
        node.cp.stop_process(f"kube-scheduler#{scheduler}")
        for name in created:
            request(api, "DELETE", f"/apis/resource.k8s.io/v1/deviceclasses/{name}")
