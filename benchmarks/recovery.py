"""Recovery: kubelet restart -> the plugin re-registered and its ListAndWatch stream delivering again."""

from __future__ import annotations

import statistics
import time

from .common import plugin_process

RESOURCE = "example.com/gpu-share"


def run(smoke: bool = False) -> dict:
    restarts = 3 if smoke else 20
    durations = []
    with plugin_process(gpus=8, replicas=64, extra=("--watch-interval", "0.2")) as (kubelet, _, _):
        for _ in range(restarts):
            started = time.perf_counter()
            kubelet.restart()
            ok = kubelet.wait_for(lambda st: st[RESOURCE].registered and st[RESOURCE].allocatable == 512, timeout=10)
            if not ok:
                raise RuntimeError("no re-registration within 10 s")
            durations.append(time.perf_counter() - started)
    ms = [d * 1000 for d in durations]
    return {"restarts": restarts, "watch_interval_s": 0.2, "median_ms": round(statistics.median(ms), 1), "max_ms": round(max(ms), 1)}
