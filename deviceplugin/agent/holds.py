"""What containers hold, read fresh: pod-resources for who holds which device now, the kubelet's checkpoint for the
shape each was granted in (the share count our Allocate answer carried), and the checkpoint alone while
pod-resources cannot be read. The plugin manager reads it before a GPU changes shape (alloc.pending).

The checkpoint (`kubelet_internal_checkpoint` in the device-plugin directory) is the kubelet's internal file: it is
only ever read, bounded, and anything in it that does not parse is skipped, never trusted. Its shape:
`{"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName", "DeviceIDs": {"<NUMA node>": [ids]}
(a flat list before Kubernetes 1.20), "AllocResp": "<base64 ContainerAllocateResponse>"}], ...}, "Checksum": N}`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from ..alloc.modes import ENV_SHARE_TOTAL
from ..api import deviceplugin_pb2 as pb
from ..api import podresources_pb2 as pr
from ..logs import safe_text
from ..model.usage import Hold
from .usage import PodResourcesClient

log = logging.getLogger(__name__)

CHECKPOINT = "kubelet_internal_checkpoint"
MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024  # the kubelet's file for a full node is a few MiB
MAX_HOLDS = 200_000  # device IDs taken from one reading; a node has at most a few thousand devices


def read_checkpoint(path: Path, ours: Callable[[str], bool]) -> dict[tuple[str, str], Hold]:
    """(resource, device ID) -> its hold, for the devices `ours(unit UUID)` accepts; {} when the file is missing or
    unreadable (said in the log)."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CHECKPOINT_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        log.warning("cannot read the kubelet checkpoint %s: %s", path, err)
        return {}
    if len(data) > MAX_CHECKPOINT_BYTES:
        log.warning("the kubelet checkpoint %s is over %d bytes: not read", path, MAX_CHECKPOINT_BYTES)
        return {}
    try:
        entries = json.loads(data)["Data"]["PodDeviceEntries"] or []
    except (ValueError, KeyError, TypeError) as err:
        log.warning("the kubelet checkpoint %s does not parse (%s): not used", path, safe_text(str(err), 200))
        return {}
    holds: dict[tuple[str, str], Hold] = {}
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict) or not isinstance(entry.get("ResourceName"), str):
            continue
        resource = entry["ResourceName"]
        holder = f"pod {safe_text(str(entry.get('PodUID', '?')), 40)} container {safe_text(str(entry.get('ContainerName', '?')), 64)}"
        replicas = _granted_replicas(entry.get("AllocResp"))
        for device in _device_ids(entry.get("DeviceIDs")):
            hold = Hold(resource, device, replicas if replicas is not None else _whole(device), holder)
            if ours(hold.unit_uuid) and len(holds) < MAX_HOLDS:
                holds[(resource, device)] = hold
    return holds


def _device_ids(value: object) -> Iterable[str]:
    """`{"<NUMA node>": [ids]}`, or a flat list (checkpoints before Kubernetes 1.20)."""
    lists = value.values() if isinstance(value, dict) else [value]
    return [i for ids in lists if isinstance(ids, list) for i in ids if isinstance(i, str)]


def _granted_replicas(alloc_resp: object) -> int | None:
    """The share count our Allocate answer carried (GPU_SHARE_TOTAL); None when it says none."""
    if not isinstance(alloc_resp, str):
        return None
    try:
        response = pb.ContainerAllocateResponse.FromString(base64.b64decode(alloc_resp, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None
    total = response.envs.get(ENV_SHARE_TOTAL, "")
    return int(total) if total.isdigit() and 0 < int(total) < 1_000_000 else None


def _whole(device: str) -> int | None:
    """A whole GPU or MIG instance (its ID is its UUID) is one replica; a share's count is unknown."""
    return 1 if Hold("", device).unit_uuid == device else None


class ContainerHolds:
    """Callable: what containers hold now. Pod-resources says who holds what (the kubelet frees the devices of
    finished pods there); the checkpoint adds the share count each was granted in. Without pod-resources (the
    kubelet is down or restarting) the checkpoint alone answers: it may list finished containers too, which only
    keeps a GPU waiting longer."""

    def __init__(self, client: PodResourcesClient, plugin_dir: Path, ours: Callable[[str], bool]) -> None:
        self.client = client
        self.checkpoint = Path(plugin_dir) / CHECKPOINT
        self.ours = ours  # whether a GPU or MIG UUID is on this node

    def __call__(self) -> frozenset[Hold]:
        granted = read_checkpoint(self.checkpoint, self.ours)
        try:
            response = self.client.list()
        except grpc.RpcError as err:
            log.warning("pod-resources List failed (%s): what containers hold is taken from the kubelet checkpoint alone", err.code().name)
            return frozenset(granted.values())
        return frozenset(holds_in(response, granted, self.ours))


def holds_in(response: pr.ListPodResourcesResponse, granted: dict[tuple[str, str], Hold], ours: Callable[[str], bool]) -> list[Hold]:
    """The holds a pod-resources List shows (at most MAX_HOLDS), with the share counts the checkpoint knows."""
    holds: list[Hold] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = safe_text(f"{pod.namespace}/{pod.name}/{container.name}", 200)
            for devices in container.devices:
                for device in devices.device_ids:
                    known = granted.get((devices.resource_name, device))
                    hold = Hold(devices.resource_name, device, known.replicas if known else _whole(device), holder)
                    if ours(hold.unit_uuid):
                        holds.append(hold)
                        if len(holds) >= MAX_HOLDS:
                            log.warning("pod-resources lists over %d of our devices: the rest are not read", MAX_HOLDS)
                            return holds
    return holds
