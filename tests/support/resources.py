"""Resources built from a one-pool config on an example node, and the device IDs a kubelet would offer of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.model.devices import Resource
from deviceplugin.model.node import NodeInfo


def one_pool(node_info: NodeInfo, pool: dict[str, Any], **top: Any) -> Resource:
    """The first resource of a config with this one pool (and top-level keys such as allocationPolicy)."""
    return build_resources(parse_config({"version": "v1", **top, "pools": [pool]}), node_info)[0]


def shared(node_info: NodeInfo, policy: str = "binpack", replicas: int = 4) -> Resource:
    return one_pool(node_info, {"name": "s", "mode": "shared", "replicas": replicas}, allocationPolicy=policy)


def free_shares(node_info: NodeInfo, counts: Mapping[int, int], replicas: int) -> list[str]:
    """Available IDs with `counts[i]` free shares on GPU i (the highest share numbers)."""
    uuids = [g.uuid for g in node_info.gpus]
    return [f"{uuids[i]}::{k}" for i, n in counts.items() for k in range(replicas - n, replicas)]


def gpus_of(node_info: NodeInfo, ids: list[str]) -> set[int]:
    """The indexes of the GPUs these share IDs are on."""
    index = {g.uuid: g.index for g in node_info.gpus}
    return {index[i.split("::")[0]] for i in ids}
