"""What containers hold, read fresh: pod-resources for who holds which device now, the kubelet's checkpoint for the
shape each was granted in (the share count our Allocate answer carried) and for the holders pod-resources never lists
(ordinary init containers), and the checkpoint alone while pod-resources cannot be read. The plugin manager reads it
before a GPU changes shape (alloc.pending).

Fail closed: a source that cannot be read is unknown, never empty. A checkpoint that exists but cannot be read or
parsed whole raises `HoldsUnknown` (the caller keeps every GPU as it is and takes no new work on a changing one
until a source answers); an entry whose share count does not parse holds its devices in an unknown shape (replicas
None), so a GPU it names keeps its shape.

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
from collections.abc import Callable
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
MAX_CHECKPOINT_BYTES = 4 * 1024 * 1024  # a full node (110 pods, a few containers each) writes about 1 MiB; parsing 4 MiB peaks near +20 MiB
MAX_HOLDS = 200_000  # device IDs taken from one reading; a node has at most a few thousand devices


class HoldsUnknown(Exception):
    """What containers hold cannot be read: treat every GPU as held, in a shape not known."""


def read_checkpoint(path: Path, ours: Callable[[str], bool]) -> dict[tuple[str, str], Hold]:
    """(resource, device ID) -> its hold, for the devices `ours(unit UUID)` accepts; {} when there is no file (a node
    the kubelet never allocated on). Raises HoldsUnknown when the file exists but cannot be read or parsed whole."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CHECKPOINT_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise HoldsUnknown(f"cannot read the kubelet checkpoint {path}: {err}") from err
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise HoldsUnknown(f"the kubelet checkpoint {path} is over {MAX_CHECKPOINT_BYTES} bytes")
    try:
        entries = json.loads(data)["Data"]["PodDeviceEntries"] or []
    except (ValueError, KeyError, TypeError) as err:
        raise HoldsUnknown(f"the kubelet checkpoint {path} does not parse ({safe_text(str(err), 200)})") from err
    if not isinstance(entries, list):
        raise HoldsUnknown(f"the kubelet checkpoint {path} has no list of entries")
    holds: dict[tuple[str, str], Hold] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("ResourceName"), str):
            raise HoldsUnknown(f"the kubelet checkpoint {path} has an entry without a resource name")
        resource = entry["ResourceName"]
        holder = f"pod {safe_text(str(entry.get('PodUID', '?')), 40)} container {safe_text(str(entry.get('ContainerName', '?')), 64)}"
        replicas = _granted_replicas(entry.get("AllocResp"))
        for device in _device_ids(entry.get("DeviceIDs")):
            hold = Hold(resource, device, replicas if replicas is not None else _whole(device), holder)
            if ours(hold.unit_uuid) and len(holds) < MAX_HOLDS:
                holds[(resource, device)] = hold
    return holds


def _device_ids(value: object) -> list[str]:
    """`{"<NUMA node>": [ids]}`, or a flat list (checkpoints before Kubernetes 1.20); HoldsUnknown for anything else
    (an entry whose devices cannot be read holds devices nobody can name)."""
    found: list[str] = []
    for ids in list(value.values()) if isinstance(value, dict) else [value]:
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise HoldsUnknown("the kubelet checkpoint has an entry whose device IDs do not parse")
        found.extend(ids)
    return found


def _granted_replicas(alloc_resp: object) -> int | None:
    """The share count our Allocate answer carried (GPU_SHARE_TOTAL); None when it says none."""
    if not isinstance(alloc_resp, str):
        return None
    try:
        response = pb.ContainerAllocateResponse.FromString(base64.b64decode(alloc_resp, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None
    total = response.envs.get(ENV_SHARE_TOTAL, "")
    # ASCII digits only: "²" passes isdigit() and fails int()
    return int(total) if total.isascii() and total.isdigit() and 0 < int(total) < 1_000_000 else None


def _whole(device: str) -> int | None:
    """A whole GPU or MIG instance (its ID is its UUID) is one replica; a share's count is unknown."""
    return 1 if Hold("", device).unit_uuid == device else None


class ContainerHolds:
    """Callable: what containers hold now, the union of what pod-resources lists (who holds what; the kubelet frees
    the devices of finished pods there) and what the checkpoint records (the share count each was granted in, and
    ordinary init containers, which pod-resources never lists). Without pod-resources (the kubelet is down or
    restarting) the checkpoint alone answers. Either may list a finished container, which only keeps a GPU waiting
    longer. A checkpoint that cannot be read leaves pod-resources' holders in an unknown shape (so their GPUs keep
    theirs); with pod-resources down too, HoldsUnknown."""

    def __init__(self, client: PodResourcesClient, plugin_dir: Path, ours: Callable[[str], bool]) -> None:
        self.client = client
        self.checkpoint = Path(plugin_dir) / CHECKPOINT
        self.ours = ours  # whether a GPU or MIG UUID is on this node

    def __call__(self) -> frozenset[Hold]:
        damaged: HoldsUnknown | None = None
        try:
            granted = read_checkpoint(self.checkpoint, self.ours)
        except HoldsUnknown as err:
            damaged, granted = err, {}
        try:
            response = self.client.list()
        except grpc.RpcError as err:
            if damaged is not None:
                raise HoldsUnknown(f"{damaged}, and pod-resources List failed ({err.code().name})") from err
            log.warning("pod-resources List failed (%s): what containers hold is taken from the kubelet checkpoint alone", err.code().name)
            return frozenset(granted.values())
        if damaged is not None:  # who holds what is known; the share counts are not: every held GPU keeps its shape
            log.warning("%s: the holders pod-resources lists are kept in the shape they have", damaged)
        listed = holds_in(response, granted, self.ours)
        seen = {(h.resource, h.device) for h in listed}
        return frozenset(listed) | frozenset(h for key, h in granted.items() if key not in seen)


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
