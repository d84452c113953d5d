"""The gpu-share config file: versioned YAML, validated with errors that name the key path.

Schema (v1)::

    version: v1                  # required
    domain: example.com          # resource domain for names without one
    allocationPolicy: binpack    # binpack | spread: where GetPreferredAllocation puts shares
    pools:                       # each GPU belongs to at most one pool
      - name: training           # [a-z0-9-], unique; used in socket names and logs
        mode: exclusive          # exclusive | shared | mig
        resource: gpu            # <name> (joined to domain) or <domain>/<name>; not for mig
        gpus:                    # selection; omitted = every GPU no other pool selects
          indexes: [0, 1]
          uuids: [GPU-...]
          models: ["*H100*"]     # shell-style patterns, case-insensitive
      - name: inference
        mode: shared
        replicas: 10             # shares per GPU (shared mode only)
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .inventory import Gpu
from .names import resource_name_problem
from .schema import Fields, SchemaError, join, list_of

SUPPORTED_VERSIONS = ("v1",)
DEFAULT_DOMAIN = "example.com"
DEFAULT_REPLICAS = 10
MODES = ("exclusive", "shared", "mig")
ALLOCATION_POLICIES = ("binpack", "spread")
DEFAULT_RESOURCE = {"exclusive": "gpu", "shared": "gpu-share"}  # mig: <domain>/mig-<profile>
_POOL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


class ConfigError(ValueError):
    """One or more problems in a config; each line is `key.path: reason`."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + ("\n  ".join([""] + problems) if len(problems) > 1 else problems[0]))


@dataclass(frozen=True)
class GpuSelector:
    indexes: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    @property
    def selects_rest(self) -> bool:
        """True when the pool takes every GPU that no other pool selects."""
        return not (self.indexes or self.uuids or self.models)

    def matches(self, gpu: Gpu) -> bool:
        return (
            gpu.index in self.indexes
            or gpu.uuid in self.uuids
            or any(fnmatch.fnmatchcase(gpu.model.lower(), p.lower()) for p in self.models)
        )


@dataclass(frozen=True)
class PoolConfig:
    name: str
    mode: str
    resource: str  # fully qualified <domain>/<name>; "" for mig pools (one resource per MIG profile)
    domain: str = DEFAULT_DOMAIN
    replicas: int = 1
    gpus: GpuSelector = field(default_factory=GpuSelector)

    @property
    def shared(self) -> bool:
        return self.mode == "shared"


@dataclass(frozen=True)
class Config:
    version: str = "v1"
    domain: str = DEFAULT_DOMAIN
    allocation_policy: str = "binpack"
    pools: tuple[PoolConfig, ...] = ()
    source: str = "built-in default"


def default_config() -> Config:
    """Every GPU in one shared pool with 10 shares per GPU."""
    return Config(
        pools=(PoolConfig(name="default", mode="shared", resource=f"{DEFAULT_DOMAIN}/gpu-share", replicas=DEFAULT_REPLICAS),)
    )


def load_config(path: str | Path) -> Config:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError([f"cannot read: {err.strerror}"], source) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], source) from None
    return parse_config(data, source)


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate a config document, collecting every problem before raising."""
    problems: list[str] = []
    try:
        top = Fields(data, "", {"version": str, "domain": str, "allocationPolicy": str, "pools": list})
    except SchemaError as err:
        raise ConfigError([str(err)], source) from None

    def attempt(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SchemaError as err:
            problems.append(str(err))
            return None

    version = attempt(top.get, "version", None, required=True)
    if version is not None and version not in SUPPORTED_VERSIONS:
        problems.append(f"version: unsupported version {version!r} (supported: {', '.join(SUPPORTED_VERSIONS)})")
    domain = attempt(top.get, "domain", DEFAULT_DOMAIN) or DEFAULT_DOMAIN
    policy = attempt(top.get, "allocationPolicy", "binpack") or "binpack"
    if policy not in ALLOCATION_POLICIES:
        problems.append(f"allocationPolicy: must be one of {', '.join(ALLOCATION_POLICIES)}, got {policy!r}")
    raw_pools = attempt(top.get, "pools", None, required=True) or []
    if top.has("pools") and not raw_pools and isinstance(top.data.get("pools"), list):
        problems.append("pools: must list at least one pool")
    pools = [attempt(_parse_pool, item, f"pools[{i}]", domain) for i, item in enumerate(raw_pools)]
    parsed = [p for p in pools if p is not None]
    problems.extend(_cross_pool_problems(pools))
    if problems:
        raise ConfigError(problems, source)
    return Config(version=version, domain=domain, allocation_policy=policy, pools=tuple(parsed), source=source)


def _parse_pool(item: Any, path: str, domain: str) -> PoolConfig:
    fields = Fields(item, path, {"name": str, "mode": str, "resource": str, "replicas": int, "gpus": dict})
    name = fields.get("name", required=True)
    fields.check(bool(_POOL_NAME.match(name)), "name", f"must be 1-40 characters of [a-z0-9-], starting and ending alphanumeric, got {name!r}")
    mode = fields.get("mode", required=True)
    fields.check(mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "mig":
        fields.check(not fields.has("resource"), "resource", "not used by mode mig: its resources are <domain>/mig-<profile>")
        resource = ""
    else:
        resource = fields.get("resource", DEFAULT_RESOURCE[mode])
        if "/" not in resource:
            resource = f"{domain}/{resource}"
        problem = resource_name_problem(resource)
        fields.check(problem is None, "resource", f"{resource!r} is not a valid extended resource name: {problem}")
    if mode == "shared":
        replicas = fields.get("replicas", DEFAULT_REPLICAS)
        fields.check(replicas >= 1, "replicas", f"must be >= 1, got {replicas}")
    else:
        fields.check(not fields.has("replicas"), "replicas", f"only applies to mode shared (this pool is {mode})")
        replicas = 1
    selector = _parse_selector(fields.get("gpus", None), join(path, "gpus")) if fields.has("gpus") else GpuSelector()
    return PoolConfig(name=name, mode=mode, resource=resource, domain=domain, replicas=replicas, gpus=selector)


def _parse_selector(data: Any, path: str) -> GpuSelector:
    fields = Fields(data, path, {"indexes": list, "uuids": list, "models": list})
    indexes = list_of(fields.get("indexes", []), join(path, "indexes"), int)
    for i, index in enumerate(indexes):
        if index < 0:
            raise SchemaError(f"{join(path, 'indexes')}[{i}]", f"must be >= 0, got {index}")
    selector = GpuSelector(
        indexes=tuple(indexes),
        uuids=tuple(list_of(fields.get("uuids", []), join(path, "uuids"), str)),
        models=tuple(list_of(fields.get("models", []), join(path, "models"), str)),
    )
    if selector.selects_rest:
        raise SchemaError(path, "selects no GPU: give indexes, uuids or models, or omit gpus to take the rest")
    return selector


def _cross_pool_problems(pools: list[PoolConfig | None]) -> list[str]:
    problems = []
    seen_names: dict[str, int] = {}
    seen_resources: dict[str, int] = {}
    rest_pool: int | None = None
    for i, pool in enumerate(pools):
        if pool is None:
            continue
        if pool.name in seen_names:
            problems.append(f"pools[{i}].name: {pool.name!r} is already used by pools[{seen_names[pool.name]}]")
        seen_names.setdefault(pool.name, i)
        if pool.resource and pool.resource in seen_resources:
            problems.append(f"pools[{i}].resource: {pool.resource!r} is already used by pools[{seen_resources[pool.resource]}]")
        seen_resources.setdefault(pool.resource, i)
        if pool.gpus.selects_rest:
            if rest_pool is not None:
                problems.append(f"pools[{i}].gpus: only one pool may omit gpus (pools[{rest_pool}] already takes the rest)")
            rest_pool = i if rest_pool is None else rest_pool
    return problems
