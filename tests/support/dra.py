"""DRA test helpers: a driver on an example node in a temporary directory, and allocated claims as the API has them."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from deviceplugin.config.parse import parse_config
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.devices import driver_name
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.prepare import ClaimRef, Driver
from deviceplugin.state import NodeState
from tests.conftest import node
from tests.support.resources import resources_of

DRIVER = driver_name("example.com")
MPS_POOLS = [{"name": "s", "mode": "shared", "replicas": 4, "backend": "mps", "mpsLimits": "proportional"}]


def make_driver(directory: Path, pools: list[dict[str, Any]] | None = None, node_name: str = "2xT4", state: NodeState | None = None) -> Driver:
    info = node(node_name)
    config = parse_config({"version": "v1", "pools": pools or MPS_POOLS})
    driver = Driver(
        DRIVER, info.name, Checkpoint(directory / "claims"), CdiWriter(directory / "cdi", DRIVER), state or NodeState(), SerialLock(directory / "serialize.lock")
    )
    driver.on_config(config, resources_of(config, info))
    return driver


def result(device: str, shares: int | None = None, request: str = "gpu", pool: str = "2xT4", driver: str = DRIVER, memory: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device, "shareID": str(uuid.uuid4())}
    consumed = {}
    if shares is not None:
        consumed["shares"] = str(shares)
    if memory is not None:
        consumed["memory"] = memory
    if consumed:
        out["consumedCapacity"] = consumed
    return out


def claim(results: list[dict[str, Any]], name: str = "c", namespace: str = "default", uid: str | None = None) -> tuple[ClaimRef, dict[str, Any]]:
    uid = uid or str(uuid.uuid4())
    body = {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "status": {"allocation": {"devices": {"results": results}}}}
    return ClaimRef(namespace, name, uid), body
