"""Start-up memory of the DRA driver's claim cache against another tenant's claims, on a real API server
(KUBEBUILDER_ASSETS: etcd + kube-apiserver; skipped without).

Another tenant creates claims at the API's maxima (32 opaque configs of 10 KiB each, for another driver) that this
node's driver never prepares. A fresh process starts the claim cache (`dra.claims.ApiClaims`), waits for its first
list and prints its peak RSS; once before the tenant's claims exist and once after. Target: +20 MB at most for 500.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "gpu.example.com"

_PROBE = """
import sys, time
from deviceplugin.dra.claims import ApiClaims
from deviceplugin.kube.rest import RestClient, load_kubeconfig
claims = ApiClaims(RestClient(load_kubeconfig(sys.argv[1])), sys.argv[2], "bench-node")
def hwm():  # this process's peak RSS in KiB (getrusage's would include the parent's, kept across exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before = hwm()
claims.start()
deadline = time.monotonic() + 120
while not claims.synced and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, hwm(), claims.synced, claims.size())
claims.stop()
"""


def _probe(kubeconfig: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(kubeconfig), DRIVER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    before, peak, synced, cached = out.stdout.split()
    if synced != "True":
        raise RuntimeError(f"the claim cache did not list: {out.stderr[-500:]}")
    return {
        "rss_before_start_mb": round(int(before) / 1024, 1),
        "peak_rss_after_list_mb": round(int(peak) / 1024, 1),
        "cached": int(cached),
    }


def _tenant_claim(name: str) -> dict:
    config = [{"opaque": {"driver": "other.example.com", "parameters": {"blob": "x" * 10_000}}} for _ in range(32)]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "other"}}], "config": config}},
    }


def run(smoke: bool = False) -> dict:
    from tests.support.controlplane import ControlPlane, assets_dir

    binaries = assets_dir()
    if binaries is None:
        return {"skipped": "needs KUBEBUILDER_ASSETS (etcd, kube-apiserver)"}
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    from tests.support.kubeobjects import namespace, request

    count = 20 if smoke else 500
    cp = ControlPlane.start(binaries)
    try:
        api = cp.api_client()
        empty = _probe(cp.admin_kubeconfig)
        ns = namespace(api, "tenant")
        body = _tenant_claim("x")
        size = len(json.dumps(body))
        for i in range(count):
            body["metadata"]["name"] = f"claim-{i}"
            request(api, "POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", body)
        full = _probe(cp.admin_kubeconfig)
    finally:
        cp.stop()
    return {
        "tenant_claims": count,
        "claim_bytes": size,
        "without_tenant": empty,
        "with_tenant": full,
        "peak_rss_increase_mb": round(full["peak_rss_after_list_mb"] - empty["peak_rss_after_list_mb"], 1),
        "target_increase_mb": 20,
    }
