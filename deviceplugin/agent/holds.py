"""What containers hold, read fresh: pod-resources for who holds which device now, the kubelet's checkpoint for the
shape each was granted in (the share count our Allocate answer carried) and for the holders pod-resources never lists
(ordinary init containers), and the checkpoint alone while pod-resources cannot be read. The plugin manager reads it
before a GPU changes shape (alloc.pending).

Fail closed: a source that cannot be read is unknown, never empty. A checkpoint that exists but cannot be read or
parsed whole, or is over a bound, raises `HoldsUnknown` (the caller keeps every GPU as it is and takes no new work
on a changing one until a source answers); an entry whose share count does not parse holds its devices in an unknown
shape (replicas None), so a GPU it names keeps its shape.

The checkpoint (`kubelet_internal_checkpoint` in the device-plugin directory) is the kubelet's internal file: it is
only ever read, never trusted, and bounded: in bytes, in entries and in bytes per entry, parsed one entry at a time
from a buffer of a few chunks, so a file at the bound costs the plugin a few MiB, not the file in Python objects (the
benchmark `python -m benchmarks.checkpoint` prints the peaks). Its shape:
`{"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName", "DeviceIDs": {"<NUMA node>": [ids]}
(a flat list before Kubernetes 1.20), "AllocResp": "<base64 ContainerAllocateResponse>"}], ...}, "Checksum": N}`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

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
MAX_CHECKPOINT_BYTES = 4 * 1024 * 1024  # a full node (110 pods, a few containers each) writes about 1 MiB
MAX_ENTRY_BYTES = 256 * 1024  # one container's devices and Allocate answer; ours are under 4 KiB
MAX_ENTRIES = 20_000  # containers with devices on one node: a few hundred at most
MAX_HOLDS = 20_000  # device IDs taken from one reading; a node has at most a few thousand devices
CHUNK = 64 * 1024
_ENTRIES_KEY = re.compile(r'"PodDeviceEntries"\s*:')
_SPACE = re.compile(r"[ \t\r\n]*")


MAX_POD_DIRS = 10_000  # pod directories read from the kubelet root; a node runs at most a few hundred pods


class HoldsUnknown(Exception):
    """No source can say what is held: every GPU keeps its shape and takes no new one until a source answers."""


def read_checkpoint(path: Path, ours: Callable[[str], bool]) -> dict[tuple[str, str], Hold]:
    """(resource, device ID) -> its hold, for the devices `ours(unit UUID)` accepts; {} when the file is missing
    (the kubelet has granted nothing yet). Raises HoldsUnknown when it cannot be read, is over a bound, or has an
    entry that does not parse."""
    try:
        with open(path, "rb") as file:
            return _read(file, path, ours)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise HoldsUnknown(f"cannot read the kubelet checkpoint {path}: {err}") from err


def _read(file: BinaryIO, path: Path, ours: Callable[[str], bool]) -> dict[tuple[str, str], Hold]:
    holds: dict[tuple[str, str], Hold] = {}
    for number, entry in enumerate(_entries(file, path)):
        if number >= MAX_ENTRIES:
            raise HoldsUnknown(f"the kubelet checkpoint {path} has over {MAX_ENTRIES} entries: not read")
        for hold in _entry_holds(entry, path):
            if ours(hold.unit_uuid):
                holds[(hold.resource, hold.device)] = hold
                if len(holds) > MAX_HOLDS:
                    raise HoldsUnknown(f"the kubelet checkpoint {path} lists over {MAX_HOLDS} of our devices: not read")
    return holds


def _entries(file: BinaryIO, path: Path) -> Iterator[object]:
    """The values of `Data.PodDeviceEntries`, decoded one at a time from a buffer of a few chunks (an entry over
    MAX_ENTRY_BYTES, a file over MAX_CHECKPOINT_BYTES or one that ends early raises HoldsUnknown)."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")("strict")
    text, pos, read = "", 0, 0

    def fill() -> bool:
        nonlocal text, pos, read
        more = file.read(min(CHUNK, MAX_CHECKPOINT_BYTES + 1 - read))
        read += len(more)
        if read > MAX_CHECKPOINT_BYTES:
            raise HoldsUnknown(f"the kubelet checkpoint {path} is over {MAX_CHECKPOINT_BYTES} bytes: not read")
        try:
            text = text[pos:] + utf8.decode(more, final=not more)
        except UnicodeDecodeError as err:
            raise HoldsUnknown(f"the kubelet checkpoint {path} is not UTF-8: not read") from err
        pos = 0
        return bool(more)

    def skip() -> str:
        """The next character after white space ("" at the end of the file)."""
        nonlocal pos
        while True:
            pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
            if pos < len(text) or not fill():
                return text[pos : pos + 1]

    fill()
    found = _ENTRIES_KEY.search(text)
    if found is None:
        raise HoldsUnknown(
            f"the kubelet checkpoint {path} has no PodDeviceEntries in its first {CHUNK} bytes: not read"
        )
    pos = found.end()
    if skip() == "n" and text.startswith("null", pos):
        return
    if skip() != "[":
        raise HoldsUnknown(f"the kubelet checkpoint {path}: PodDeviceEntries is not a list: not read")
    pos += 1
    if skip() == "]":
        return
    while True:
        while True:
            try:
                value, end = decoder.raw_decode(text, pos)
                break
            except ValueError as err:
                if len(text) - pos > MAX_ENTRY_BYTES:
                    raise HoldsUnknown(
                        f"the kubelet checkpoint {path} has an entry over {MAX_ENTRY_BYTES} bytes: not read"
                    ) from err
                if not fill():
                    raise HoldsUnknown(
                        f"the kubelet checkpoint {path} is truncated or does not parse: not read"
                    ) from err
        if end - pos > MAX_ENTRY_BYTES:
            raise HoldsUnknown(f"the kubelet checkpoint {path} has an entry over {MAX_ENTRY_BYTES} bytes: not read")
        yield value
        pos = end
        after = skip()
        if after == "]":
            return
        if after != ",":
            raise HoldsUnknown(f"the kubelet checkpoint {path} is truncated or does not parse after an entry: not read")
        pos += 1
        skip()


def _entry_holds(entry: object, path: Path) -> list[Hold]:
    """The holds one checkpoint entry records; HoldsUnknown when it does not say which devices of which resource."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ResourceName"), str):
        raise HoldsUnknown(f"the kubelet checkpoint {path} has an entry without a ResourceName: not read")
    devices = _device_ids(entry.get("DeviceIDs"))
    if devices is None:
        raise HoldsUnknown(
            f"the kubelet checkpoint {path} has an entry of {safe_text(entry['ResourceName'], 100)} whose "
            "DeviceIDs do not parse: not read"
        )
    resource = entry["ResourceName"]
    holder = (
        f"pod {safe_text(str(entry.get('PodUID', '?')), 40)} "
        f"container {safe_text(str(entry.get('ContainerName', '?')), 64)}"
    )
    replicas = _granted_replicas(entry.get("AllocResp"))
    uid = entry["PodUID"] if isinstance(entry.get("PodUID"), str) else ""
    return [
        Hold(resource, device, replicas if replicas is not None else _whole(device), holder, uid) for device in devices
    ]


def _device_ids(value: object) -> list[str] | None:
    """`{"<NUMA node>": [ids]}`, or a flat list (checkpoints before Kubernetes 1.20); None when it is neither."""
    if value is None:
        return []
    found: list[str] = []
    for ids in list(value.values()) if isinstance(value, dict) else [value]:
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return None
        found.extend(ids)
    return found


def _granted_replicas(alloc_resp: object) -> int | None:
    """The share count our Allocate answer carried (GPU_SHARE_TOTAL); None when it says none or none that parses."""
    if not isinstance(alloc_resp, str):
        return None
    try:
        response = pb.ContainerAllocateResponse.FromString(base64.b64decode(alloc_resp, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        return None
    total = response.envs.get(ENV_SHARE_TOTAL, "")
    if not (total.isascii() and total.isdigit() and 0 < len(total) < 7):
        return None
    return int(total) or None


def _whole(device: str) -> int | None:
    """A whole GPU or MIG instance (its ID is its UUID) is one replica; a share's count is unknown."""
    return 1 if Hold("", device).unit_uuid == device else None


class ContainerHolds:
    """Callable: what containers hold now, the union of what pod-resources lists (who holds what; the kubelet frees
    the devices of finished pods there) and what the checkpoint records (the share count each was granted in, and
    ordinary init containers, which pod-resources never lists). Without pod-resources (the kubelet is down or
    restarting) the checkpoint alone answers. Either may list a finished container, which only keeps a GPU waiting
    longer. A checkpoint that cannot be read leaves pod-resources' holders in an unknown shape (so their GPUs keep
    theirs); with pod-resources down too, HoldsUnknown.

    The kubelet drops a deleted pod's checkpoint entry only at its next write (an allocation, a device-list update),
    so a holder only the checkpoint names counts while its pod's directory (`<kubelet root>/pods/<UID>`) exists;
    when that directory cannot be listed (not mounted, unreadable), every such holder counts (fail closed)."""

    def __init__(
        self, client: PodResourcesClient, plugin_dir: Path, ours: Callable[[str], bool], pods_dir: Path | None = None
    ) -> None:
        self.client = client
        self.checkpoint = Path(plugin_dir) / CHECKPOINT
        self.ours = ours  # whether a GPU or MIG UUID is on this node
        # the kubelet's layout: <root>/device-plugins beside <root>/pods; elsewhere (tests, odd set-ups) unknown
        kubelet_layout = Path(plugin_dir).name == "device-plugins"
        self.pods_dir = (
            Path(pods_dir) if pods_dir is not None else Path(plugin_dir).parent / "pods" if kubelet_layout else None
        )

    def _pods_on_node(self) -> frozenset[str] | None:
        """The UIDs of the pods the kubelet keeps a directory for; None when that cannot be told."""
        if self.pods_dir is None:
            return None
        try:
            with os.scandir(self.pods_dir) as entries:
                names = [e.name for e in itertools.islice(entries, MAX_POD_DIRS + 1)]
        except OSError:
            return None
        return frozenset(names) if len(names) <= MAX_POD_DIRS else None

    def _alive(self, holds: Iterable[Hold]) -> frozenset[Hold]:
        """The checkpoint's holds whose pods are still on the node (all of them when that cannot be told)."""
        pods = self._pods_on_node()
        return frozenset(h for h in holds if pods is None or not h.pod_uid or h.pod_uid in pods)

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
            log.warning(
                "pod-resources List failed (%s): what containers hold is taken from the kubelet checkpoint alone",
                err.code().name,
            )
            return self._alive(granted.values())
        if damaged is not None:  # who holds what is known; the share counts are not: every held GPU keeps its shape
            log.warning("%s: the holders pod-resources lists are kept in the shape they have", damaged)
        listed = holds_in(response, granted, self.ours)
        seen = {(h.resource, h.device) for h in listed}
        return frozenset(listed) | self._alive(h for key, h in granted.items() if key not in seen)


def holds_in(
    response: pr.ListPodResourcesResponse, granted: dict[tuple[str, str], Hold], ours: Callable[[str], bool]
) -> list[Hold]:
    """The holds a pod-resources List shows, each device once (the kubelet lists one entry per device ID and NUMA
    node), with the share counts the checkpoint knows; HoldsUnknown over MAX_HOLDS."""
    holds: dict[tuple[str, str], Hold] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = safe_text(f"{pod.namespace}/{pod.name}/{container.name}", 200)
            for devices in container.devices:
                for device in devices.device_ids:
                    key = (devices.resource_name, device)
                    if key in holds:
                        continue
                    known = granted.get(key)
                    hold = Hold(devices.resource_name, device, known.replicas if known else _whole(device), holder)
                    if ours(hold.unit_uuid):
                        holds[key] = hold
                        if len(holds) > MAX_HOLDS:
                            raise HoldsUnknown(f"pod-resources lists over {MAX_HOLDS} of our devices: not read")
    return list(holds.values())
