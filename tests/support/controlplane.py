"""A real Kubernetes control plane for tests: etcd, kube-apiserver and (on demand) kube-scheduler on loopback.

The binaries come from `KUBEBUILDER_ASSETS` (envtest's convention: a directory holding `etcd`, `kube-apiserver`,
`kube-scheduler`); tests that need them are skipped without it. One API server serves the whole test session
(`tests/conftest.py` fixture `controlplane`); tests use fresh names (namespaces are never finalised: there is no
namespace controller, nor a kubelet, a controller manager or a ServiceAccount controller).

Authentication is by static bearer tokens (an admin in `system:masters` and `system:kube-scheduler`); the server's
certificate is the self-signed one it generates, so clients skip verification (loopback only).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler")


def assets_dir() -> Path | None:
    """The directory of the control-plane binaries, or None when `KUBEBUILDER_ASSETS` does not name a complete one."""
    value = os.environ.get("KUBEBUILDER_ASSETS", "")
    if not value:
        return None
    path = Path(value)
    return path if all((path / b).is_file() for b in BINARIES) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kubeconfig(server: str, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cp", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "cp", "context": {"cluster": "cp", "user": user}}],
        "current-context": "cp",
    }


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver; `scheduler()` adds a kube-scheduler with a given configuration."""

    bin: Path
    work: Path
    server: str = ""
    admin_kubeconfig: Path = Path()
    scheduler_kubeconfig: Path = Path()
    admin_token: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @classmethod
    def start(cls, bin_dir: Path, timeout: float = 90.0) -> ControlPlane:
        cp = cls(bin=bin_dir, work=Path(tempfile.mkdtemp(prefix="gs-cp-")))
        try:
            cp._start(timeout)
        except BaseException:
            cp.stop()
            raise
        return cp

    def _start(self, timeout: float) -> None:
        work = self.work
        (work / "logs").mkdir()
        self.admin_token, scheduler_token = secrets.token_hex(16), secrets.token_hex(16)
        (work / "tokens.csv").write_text(
            f'{self.admin_token},gs-admin,gs-admin,"system:masters"\n{scheduler_token},system:kube-scheduler,system:kube-scheduler\n'
        )
        subprocess.run(["openssl", "genrsa", "-out", str(work / "sa.key"), "2048"], check=True, capture_output=True)
        self._client_pki(work / "pki")
        etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
        self._spawn(
            "etcd",
            [
                "--name=gs",
                f"--data-dir={work / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--tls-cert-file={work / 'pki' / 'server.crt'}",
                f"--tls-private-key-file={work / 'pki' / 'server.key'}",
                f"--token-auth-file={work / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--anonymous-auth=false",
                f"--service-account-key-file={work / 'sa.key'}",
                f"--service-account-signing-key-file={work / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
                "--profiling=false",
                "--v=1",
                # a real kubelet (tests/realnode) signs in with a client cert of this CA and accepts the admin's
                f"--client-ca-file={work / 'pki' / 'ca.crt'}",
                f"--kubelet-client-certificate={work / 'pki' / 'admin.crt'}",
                f"--kubelet-client-key={work / 'pki' / 'admin.key'}",
                "--kubelet-preferred-address-types=Hostname,InternalIP",
            ],
        )
        self.admin_kubeconfig = work / "admin.kubeconfig"
        self.admin_kubeconfig.write_text(yaml.safe_dump(_kubeconfig(self.server, "gs-admin", self.admin_token)))
        self.scheduler_kubeconfig = work / "scheduler.kubeconfig"
        self.scheduler_kubeconfig.write_text(
            yaml.safe_dump(_kubeconfig(self.server, "system:kube-scheduler", scheduler_token))
        )
        self._wait_ready(timeout)

    @staticmethod
    def _client_pki(pki: Path) -> None:
        """A CA (ca.crt/ca.key: it signs a real kubelet's client cert) that also signed the server's cert and an admin
        client cert in system:masters (the API server's own client cert to kubelets)."""
        pki.mkdir()

        def ssl_(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

        ssl_(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "365",
            "-subj",
            "/CN=gs-test-ca",
        )
        ssl_(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "admin.key",
            "-out",
            "admin.csr",
            "-subj",
            "/O=system:masters/CN=gs-kubelet-client",
        )
        (pki / "client.ext").write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
        )
        ssl_(
            "x509",
            "-req",
            "-in",
            "admin.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "admin.crt",
            "-days",
            "365",
            "-extfile",
            "client.ext",
        )
        ssl_(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=kube-apiserver",
        )
        (pki / "server.ext").write_text(
            "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        )
        ssl_(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "365",
            "-extfile",
            "server.ext",
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.work / "logs" / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [str(self.bin / name.split("#")[0]), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def _wait_ready(self, timeout: float) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(
            self.server + "/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {self.log_tail(name)}")
            try:
                if urllib.request.urlopen(request, context=context, timeout=2).read() == b"ok":
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kube-apiserver not ready after {timeout:g} s: {self.log_tail('kube-apiserver')}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.work / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def scheduler(self, config: dict[str, Any], name: str = "default") -> subprocess.Popen[bytes]:
        """Start a kube-scheduler with this KubeSchedulerConfiguration (client connection and leader election filled
        in)."""
        config = {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration", **config}
        config["clientConnection"] = {"kubeconfig": str(self.scheduler_kubeconfig), "qps": 200, "burst": 400}
        config["leaderElection"] = {"leaderElect": False}
        path = self.work / f"scheduler-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return self._spawn(f"kube-scheduler#{name}", [f"--config={path}", "--secure-port=0", "--v=2"])

    def stop_process(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop(self) -> None:
        for name in sorted(self.procs, key=lambda n: n == "etcd"):  # etcd last
            self.stop_process(name)
        shutil.rmtree(self.work, ignore_errors=True)

    def api_client(self) -> Any:
        """A kubernetes ApiClient with admin rights."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.admin_kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def rest_client(self, timeout: float = 10.0) -> Any:
        """A `kube.rest` client with admin rights (what the node daemons take)."""
        from deviceplugin.kube.rest import RestClient, load_kubeconfig

        return RestClient(load_kubeconfig(self.admin_kubeconfig), timeout)
