"""DRA test helpers: a driver on an example node in a temporary directory, and allocated claims as the API has them."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

from deviceplugin.config.parse import parse_config
from deviceplugin.dra.cdi import CdiWriter
from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.lock import SerialLock
from deviceplugin.dra.prepare import ClaimRef, Driver
from deviceplugin.kube.dranames import driver_name
from deviceplugin.state import NodeState
from tests.conftest import node
from tests.support.resources import resources_of

DRIVER = driver_name("example.com")
MPS_POOLS = [{"name": "s", "mode": "shared", "replicas": 4, "backend": "mps", "mpsLimits": "proportional"}]


def make_driver(
    directory: Path, pools: list[dict[str, Any]] | None = None, node_name: str = "2xT4", state: NodeState | None = None
) -> Driver:
    info = node(node_name)
    config = parse_config({"version": "v1", "pools": pools or MPS_POOLS})
    driver = Driver(
        DRIVER,
        info.name,
        Checkpoint(directory / "claims"),
        CdiWriter(directory / "cdi", DRIVER),
        state or NodeState(),
        SerialLock(directory / "serialize.lock"),
    )
    driver.on_config(config, resources_of(config, info))
    return driver


def result(
    device: str,
    shares: int | None = None,
    request: str = "gpu",
    pool: str = "2xT4",
    driver: str = DRIVER,
    memory: str | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "request": request,
        "driver": driver,
        "pool": pool,
        "device": device,
        "shareID": str(uuid.uuid4()),
    }
    consumed = {}
    if shares is not None:
        consumed["shares"] = str(shares)
    if memory is not None:
        consumed["memory"] = memory
    if consumed:
        out["consumedCapacity"] = consumed
    return out


def claim(
    results: list[dict[str, Any]], name: str = "c", namespace: str = "default", uid: str | None = None
) -> tuple[ClaimRef, dict[str, Any]]:
    uid = uid or str(uuid.uuid4())
    body = {
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }
    return ClaimRef(namespace, name, uid), body


class MemoryClaims:
    """A claim source (`prepare.ClaimSource`) from memory: `api` is what the API serves, `cache` what a watch cache
    holds (stale when a test says so); a UID in `hang` blocks its read until the event is set, whatever its timeout."""

    def __init__(self) -> None:
        self.api: dict[str, dict[str, Any]] = {}
        self.cache: dict[str, dict[str, Any]] = {}
        self.current = True
        self.gets: list[str] = []
        self.hang: dict[str, threading.Event] = {}

    def put(self, body: dict[str, Any], cached: bool = True) -> None:
        self.api[body["metadata"]["uid"]] = body
        if cached:
            self.cache[body["metadata"]["uid"]] = body

    def cached(self, ref: ClaimRef) -> dict[str, Any] | None:
        return self.cache.get(ref.uid) if self.current else None

    def get(self, ref: ClaimRef, timeout: float) -> dict[str, Any]:
        self.gets.append(ref.uid)
        if ref.uid in self.hang:
            self.hang[ref.uid].wait()  # hung past its timeout (as a read stuck in DNS or TLS can be)
        if ref.uid not in self.api:
            raise ClaimError(f"claim {ref} not found in the API")
        return self.api[ref.uid]
