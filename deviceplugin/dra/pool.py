"""The node's pool as ResourceSlices, and the writes that turn what the API server holds into it.

Pure data, no transport (the slice publisher does the calls). One pool per node, named after the node; its
devices in GPU-index order, cut into slices of `MAX_DEVICES_PER_SLICE`, named `<node>-<driver>-<index>` (the
scheduler's first fit walks slices by name, so the index is zero-padded); an empty slice when there is no device,
so the pool shows the driver is there.

Generation and resourceSliceCount follow the scheduler's rule: it uses only the slices of a pool's highest
generation, and only when there are `resourceSliceCount` of them. So a change of one slice keeps the generation
(one write, the pool is never incomplete), and a change touching more than one slice, or creating one, moves every
slice to the next generation. Obsolete slices (another name, another pool) are deleted first, each with its UID and
resourceVersion as preconditions; changed ones are replaced (PUT with the resourceVersion read: a 409 means
someone wrote in between, so the publisher reads again); missing ones are created.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from ..model.quantity import parse_quantity
from .devices import MAX_DEVICES_PER_SLICE
from .partitions import MAX_COUNTER_SETS_PER_SLICE

API_VERSION = "resource.k8s.io/v1"
MAX_NAME = 253  # metadata.name: a DNS subdomain
INDEX_DIGITS = 4
_QUANTITY_KEYS = ("default", "min", "max", "step")


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`; a node name too long for that is cut and given a digest, so names stay unique."""
    base = f"{node}-{driver}"
    room = MAX_NAME - INDEX_DIGITS - 1
    if len(base) > room:
        digest = hashlib.sha256(base.encode()).hexdigest()[:10]
        base = base[: room - len(digest) - 1].rstrip(".-") + "-" + digest
    return f"{base}-{index:0{INDEX_DIGITS}d}"


def chunks(devices: Sequence[dict[str, Any]], size: int = MAX_DEVICES_PER_SLICE) -> list[list[dict[str, Any]]]:
    """The devices cut into slices; one empty slice when there are none."""
    return [list(devices[i : i + size]) for i in range(0, len(devices), size)] or [[]]


def owner_reference(node: str, uid: str) -> dict[str, Any]:
    """The Node as the slices' controller: deleting the Node garbage-collects them."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}


@dataclass(frozen=True)
class Stored:
    """A slice as the API server holds it."""

    name: str
    uid: str
    resource_version: str
    generation: int
    pool: str
    spec: Mapping[str, Any]
    owners: tuple[Mapping[str, Any], ...]
    writer: str = ""  # the annotation `<driver>/writer` of the instance that last wrote it ("" when none)

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> Stored:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        pool = spec.get("pool") or {}
        annotations = meta.get("annotations") or {}
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            generation=int(pool.get("generation") or 0),
            pool=str(pool.get("name", "")),
            spec=spec,
            owners=tuple(meta.get("ownerReferences") or ()),
            writer=str(annotations.get(writer_key(str(spec.get("driver", "")))) or "")[:MAX_WRITER],
        )


MAX_WRITER = 128  # `<start ns>-<pod UID or pid>`: about 60 characters


def writer_key(driver: str) -> str:
    """The slice annotation naming the driver instance that wrote it: during a rolling update (two instances of one
    driver on one node, `--pod-uid`) the newer one publishes and the older stops writing (dra.slices)."""
    return f"{driver}/writer"


def writer_started(writer: str) -> int | None:
    """When the instance named by a writer annotation started (ns since the epoch); None when it does not parse."""
    head = writer.split("-", 1)[0]
    return int(head) if head.isdigit() and len(head) <= 20 else None


@dataclass(frozen=True)
class SliceWrites:
    """The writes of one publish round, in the order they must happen: deletes, updates, creates."""

    generation: int
    deletes: tuple[Stored, ...] = ()
    updates: tuple[dict[str, Any], ...] = ()  # full objects with metadata.resourceVersion
    creates: tuple[dict[str, Any], ...] = ()
    desired: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # name -> the spec every write aims at

    @property
    def count(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


@dataclass(frozen=True)
class Pool:
    """What the node publishes: its identity, its devices (resource.k8s.io/v1 Device dicts, taints included) and the
    counter sets its dynamic-MIG devices consume (`dra.partitions`), in slices of their own before the devices'."""

    node: str
    driver: str
    owner: Mapping[str, Any]
    devices: Sequence[dict[str, Any]]
    counter_sets: Sequence[dict[str, Any]] = ()
    writer: str = ""  # this instance, as `writer_key`'s annotation names it on every slice it writes

    def specs(self, generation: int) -> dict[str, dict[str, Any]]:
        counters = [
            list(self.counter_sets[i : i + MAX_COUNTER_SETS_PER_SLICE])
            for i in range(0, len(self.counter_sets), MAX_COUNTER_SETS_PER_SLICE)
        ]
        parts: list[tuple[str, list[dict[str, Any]]]] = [("sharedCounters", c) for c in counters]
        if self.devices or not counters:
            parts += [("devices", d) for d in chunks(self.devices)]
        return {
            slice_name(self.node, self.driver, i): {
                "driver": self.driver,
                "nodeName": self.node,
                "pool": {"name": self.node, "generation": generation, "resourceSliceCount": len(parts)},
                key: part,
            }
            for i, (key, part) in enumerate(parts)
        }

    def writes(self, stored: Sequence[Stored], adopted: Mapping[str, Any] | None = None) -> SliceWrites:
        """The writes that make `stored` (the slices listed for this driver and node) this pool.

        `adopted`: slice name -> the canonical spec the API server kept for what we last wrote there, when it
        differed (a field of a disabled feature gate dropped): it counts as written, so the publisher does not
        rewrite it forever."""
        adopted = adopted or {}
        names = self.specs(0).keys()
        deletes, matched = [], {}
        for s in stored:
            if s.name in names and s.name not in matched and s.pool == self.node:
                matched[s.name] = s
            else:
                deletes.append(s)
        top = max((s.generation for s in stored), default=0)
        missing = [n for n in names if n not in matched]
        specs = self.specs(top)
        changed = [n for n, s in matched.items() if not self.matches(s, specs[n], adopted.get(n))]
        if missing or len(changed) > 1:
            specs = self.specs(top + 1)
            changed = list(matched)
        generation = specs[next(iter(specs))]["pool"]["generation"]
        updates = [self._object(n, specs[n], matched[n]) for n in changed]
        creates = [self._object(n, specs[n], None) for n in missing]
        return SliceWrites(generation, tuple(deletes), tuple(updates), tuple(creates), specs)

    def matches(self, stored: Stored, spec: Mapping[str, Any], adopted: Any = None) -> bool:
        """The stored slice is `spec`, owned by the Node (or what the server kept of it: `adopted`)."""
        if not any(o.get("uid") == self.owner["uid"] and o.get("controller") for o in stored.owners):
            return False
        have = canonical(stored.spec)
        return have == canonical(spec) or (adopted is not None and have == adopted)

    def _object(self, name: str, spec: dict[str, Any], stored: Stored | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "ownerReferences": [dict(self.owner)]}
        if self.writer:
            metadata["annotations"] = {writer_key(self.driver): self.writer}
        if stored is not None:
            metadata["resourceVersion"] = stored.resource_version
            spec = _keep_taint_times(spec, stored.spec)
        return {"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec}


def canonical(spec: Mapping[str, Any]) -> Any:
    """A spec in a form where equal content compares equal: the API server rewrites quantities canonically
    ("4026531840" comes back as "3840Mi"), stamps taints with `timeAdded` and leaves out an empty device list."""
    out = copy.deepcopy(dict(spec))
    if not out.get("devices"):
        out.pop("devices", None)
    for counter_set in out.get("sharedCounters") or []:
        _canonical_counters(counter_set.get("counters") or {})
    for device in out.get("devices") or []:
        for consumed in device.get("consumesCounters") or []:
            _canonical_counters(consumed.get("counters") or {})
        for capacity in (device.get("capacity") or {}).values():
            if "value" in capacity:
                capacity["value"] = _quantity(capacity["value"])
            policy = capacity.get("requestPolicy") or {}
            if "default" in policy:
                policy["default"] = _quantity(policy["default"])
            for key in _QUANTITY_KEYS:
                if key in (policy.get("validRange") or {}):
                    policy["validRange"][key] = _quantity(policy["validRange"][key])
            if "validValues" in policy:
                policy["validValues"] = [_quantity(v) for v in policy["validValues"]]
        for taint in device.get("taints") or []:
            taint.pop("timeAdded", None)
    return out


def _canonical_counters(counters: dict[str, Any]) -> None:
    for counter in counters.values():
        if isinstance(counter, dict) and "value" in counter:
            counter["value"] = _quantity(counter["value"])


def _quantity(value: Any) -> Decimal | str:
    try:
        return parse_quantity(str(value)).normalize()
    except ValueError:
        return str(value)


def _keep_taint_times(spec: dict[str, Any], stored: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with the stored `timeAdded` of every taint that stays (a rewrite must not make old taints new)."""
    times = {
        (d.get("name"), t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
        for d in stored.get("devices") or []
        for t in d.get("taints") or []
        if t.get("timeAdded")
    }
    if not times:
        return spec
    spec = copy.deepcopy(spec)
    for device in spec.get("devices") or []:
        for taint in device.get("taints") or []:
            added = times.get((device["name"], taint["key"], taint.get("value"), taint["effect"]))
            if added:
                taint["timeAdded"] = added
    return spec
