"""Recovery: kubelet restart -> Register received (from the new kubelet.sock's creation: inotify), and
-> the plugin's device list back at the kubelet (the whole restart, the simulator's own teardown included)."""

from __future__ import annotations

import os
import statistics
import time

from .common import plugin_process
from .kubelet_link import wait_register

RESOURCE = "example.com/gpu-share"


def run(smoke: bool = False) -> dict:
    restarts = 3 if smoke else 50
    to_register, to_devices = [], []
    with plugin_process(gpus=8, replicas=64) as (kubelet, _, _):
        for _ in range(restarts):
            before = len(kubelet.register_times)
            started = time.perf_counter()
            kubelet.restart()
            created = os.stat(kubelet.socket).st_ctime_ns / 1e9
            to_register.append(wait_register(kubelet, before, 10, after=created) - created)
            if not kubelet.wait_for(lambda st: st[RESOURCE].registered and st[RESOURCE].allocatable == 512, timeout=10):
                raise RuntimeError("no re-registration within 10 s")
            to_devices.append(time.perf_counter() - started)
            time.sleep(0.05)
    register_ms, devices_ms = [d * 1000 for d in to_register], [d * 1000 for d in to_devices]
    return {
        "restarts": restarts,
        "socket_created_to_register_median_ms": round(statistics.median(register_ms), 1),
        "socket_created_to_register_max_ms": round(max(register_ms), 1),
        "restart_to_devices_median_ms": round(statistics.median(devices_ms), 1),
        "restart_to_devices_max_ms": round(max(devices_ms), 1),
    }
