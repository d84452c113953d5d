"""The inventory annotation, version 2: what the node plugin writes and the scheduler extender reads.

`<domain>/gpu-share.inventory` on the Node holds compact JSON (docs/architecture.md shows an example):

    {"version": 2, "generation": G,
     "gpus": [{"index", "uuid", "model", "memoryMiB", "health"}],
     "resources": {NAME: {"pool", "allowSpanGPUs", "allocationPolicy",
                      "units": [{"uuid", "gpu", "profile"?, "total", "used", "free", "health"}]}},
     "pods": [digest of "namespace/name" of every pod holding devices of these resources]}

A unit is what one container's shares come from: a whole GPU or one MIG instance (`gpu` is its parent's
index, `profile` only for MIG). `health` is Healthy, Unhealthy or Quarantined; `free` is what a new container
can get now (0 unless Healthy). `generation` increases whenever the content changes, across plugin restarts too.
This module is pure (no grpc, protobuf or kubernetes) so the extender can use it.
"""

from __future__ import annotations

import hashlib

from ..model.devices import HEALTHY, UNHEALTHY

ANNOTATION = "gpu-share.inventory"  # full key: <domain>/gpu-share.inventory
VERSION = 2
QUARANTINED = "Quarantined"  # the annotation's third health value: the residue guard holds the GPU's free devices back
HEALTH_VALUES = (HEALTHY, UNHEALTHY, QUARANTINED)


def pod_digest(namespace: str, name: str) -> str:
    """8 hex digits naming a pod in `pods`: short, and enough to tell a node's pods apart."""
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:8]
