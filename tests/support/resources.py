"""Resources built from a config on an example node (the one way tests build them), and the device IDs a kubelet would
offer of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deviceplugin.alloc.plan import build_resources
from deviceplugin.config.parse import parse_config
from deviceplugin.config.types import Config, default_config
from deviceplugin.model.devices import Resource
from deviceplugin.model.node import NodeInfo


def resources_of(
    config: Mapping[str, Any] | Config | None, node_info: NodeInfo, profile: str | None = None
) -> list[Resource]:
    """The resources of a config (a dict as the YAML file has it, a parsed Config, or None: the default) on a node."""
    if config is None:
        config = default_config()
    elif not isinstance(config, Config):
        config = parse_config(dict(config))
    return build_resources(config, node_info, profile)


def one_pool(node_info: NodeInfo, pool: dict[str, Any], **top: Any) -> Resource:
    """The first resource of a config with this one pool (and top-level keys such as allocationPolicy)."""
    return resources_of({"version": "v1", **top, "pools": [pool]}, node_info)[0]


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
