"""The core is transport-free: model, alloc (with the cluster policy placement calls), config and discovery import
neither grpc nor protobuf, nor the metrics or Kubernetes clients."""

from __future__ import annotations

import json
import subprocess
import sys

TRANSPORTS = ("grpc", "google.protobuf", "prometheus_client", "kubernetes")
CORE = ("deviceplugin.model", "deviceplugin.alloc", "deviceplugin.config", "deviceplugin.discovery")

PROBE = f"""
import importlib, json, pkgutil, sys
names = []
for package in {CORE!r}:
    module = importlib.import_module(package)
    names += [package] + [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
names.append("deviceplugin.cluster.policies")  # placement's fgdstrand choice imports it on first use
# the DRA device model is core too: the publisher and the kubelet plugin share it
names.append("deviceplugin.dra.devices")
# the driver's node logic
names += ["deviceplugin.dra." + m for m in ("prepare", "checkpoint", "cdi", "health", "lock")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if any(m == t or m.startswith(t + ".") for t in {TRANSPORTS!r}))
print(json.dumps({{"imported": names, "loaded": loaded}}))
"""


def test_the_core_imports_no_transport():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert {
        "deviceplugin.model.devices",
        "deviceplugin.model.shares",
        "deviceplugin.alloc.placement",
        "deviceplugin.alloc.allocator",
        "deviceplugin.alloc.devicenodes",
        "deviceplugin.alloc.plan",
        "deviceplugin.alloc.check",
    } <= set(report["imported"])
    assert report["loaded"] == []
