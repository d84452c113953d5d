"""Parsing and validating the config file: versioned YAML, errors that name the key path (types.py has the result)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .. import limits
from ..logs import safe_text
from ..model.quantity import quantity_mib
from .names import resource_name_problem
from .paths import POOL_NAME, POOL_NAME_RULE, mps_root_problem, path_problem
from .schema import Fields, SchemaError, join, list_of
from .types import (
    ALLOCATION_POLICIES,
    BACKENDS,
    DEFAULT_MPS_ROOT,
    DEFAULT_PROFILE,
    DEFAULT_REPLICAS,
    DEFAULT_RESOURCE,
    DEVICE_LIST_STRATEGIES,
    DOMAIN_ENV,
    DYNAMIC_MIG_RESOURCE,
    MIG_STRATEGIES,
    MODES,
    MPS_LIMIT_REASON,
    MPS_LIMITS,
    SUPPORTED_VERSIONS,
    WATCHDOG_POLICIES,
    Backend,
    Choice,
    Config,
    ConfigError,
    GpuSelector,
    PoolConfig,
    default_domain,
    max_replicas,
    one_of,
)
from .yamlfile import YamlProblem, decode, load_yaml_lines, read_bounded

_CDI_KIND = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$")

_TOP_KEYS = {
    "version": str,
    "domain": str,
    "allocationPolicy": str,
    "deviceListStrategy": str,
    "cdiKind": str,
    "deviceSpecs": bool,
    "sharedProductSuffix": bool,
    "deprecatedCudaLabels": bool,
    "deviceRoot": str,
    "mpsRoot": str,
    "defaultProfile": str,
    "memoryWatchdog": dict,
    "pools": list,
    "profiles": dict,
}
_NVIDIA_TOP_KEYS = ("flags", "resources", "sharing")  # the top of NVIDIA's device plugin config (version v1 too)
# The pool keys only one mode takes (every other key applies to all modes, or to a backend).
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "shared": ("memoryPerShare", "backend", "allowSpanGPUs"),
    "mig": ("strategy",),
}
_POOL_KEYS = {
    "name": str,
    "mode": str,
    "resource": str,
    "replicas": int,
    "memoryPerShare": str,
    "backend": str,
    "mpsLimits": str,
    "exclusiveProcess": bool,
    "sharingStrategies": list,
    "allowSpanGPUs": bool,
    "strategy": str,
    "gpus": dict,
}


def load_config(path: str | Path) -> Config:
    """Read (bounded), parse and validate a config file; ConfigError on any problem, the file's own included."""
    return parse_config_bytes(read_config_bytes(path), str(path))


def read_config_bytes(path: str | Path) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES; ConfigError naming the cause (missing, symlink loop, too big)."""
    try:
        return read_bounded(path)
    except YamlProblem as err:
        raise ConfigError([str(err)], str(path)) from None


def parse_config_bytes(data: bytes, source: str = "config") -> Config:
    try:
        return parse_config_text(decode(data), source)
    except YamlProblem as err:
        raise ConfigError([str(err)], source) from None


def parse_config_text(text: str, source: str = "config") -> Config:
    if len(text) > limits.MAX_CONFIG_BYTES:
        raise ConfigError([f"file: is {len(text)} characters, over the limit of {limits.MAX_CONFIG_BYTES}"], source)
    try:
        data, duplicates, lines = load_yaml_lines(text)
    except YamlProblem as err:
        raise ConfigError([str(err)], source) from None
    try:
        config = parse_config(data, source)
    except ConfigError as err:
        raise ConfigError(duplicates + [_with_line(p, lines) for p in err.problems], source) from None
    if duplicates:
        raise ConfigError(duplicates, source)
    return config


def _with_line(problem: str, lines: dict[str, int]) -> str:
    """`key.path: reason (line N)` where the file has that key (a missing key: its parent's line)."""
    path = problem.split(": ", 1)[0]
    while path and path not in lines:
        path = path[: path.rindex("[")] if path.endswith("]") else path.rpartition(".")[0]
    return f"{problem} (line {lines[path]})" if path else problem


class _Problems:
    """Collects every problem so a config check reports them all at once."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def attempt(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PoolErrors as err:
            self.items.extend(err.problems)
            return None
        except SchemaError as err:
            self.items.append(str(err))
            return None

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.items.append(message)


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate a config document, collecting every problem before raising."""
    problems = _Problems()
    try:
        top = Fields(data, "", _TOP_KEYS, problems.items)
    except SchemaError as err:
        raise ConfigError([str(err)], source) from None
    nvidia = sorted(k for k in _NVIDIA_TOP_KEYS if isinstance(data, dict) and k in data)
    problems.check(
        not nvidia,
        f"{', '.join(nvidia)}: NVIDIA's device plugin config keys; "
        "docs/migration.md maps each onto gpu-share's pools and keys",
    )

    def choice(key: str, default: Choice, allowed: tuple[Choice, ...]) -> Choice:
        value = problems.attempt(top.get, key, default) or default
        problems.check(value in allowed, f"{key}: must be one of {', '.join(allowed)}, got {value!r}")
        return one_of(value, allowed, default)

    version = problems.attempt(top.get, "version", None, required=True)
    problems.check(
        version is None or version in SUPPORTED_VERSIONS,
        f"version: unsupported version {version!r} (supported: {', '.join(SUPPORTED_VERSIONS)})",
    )
    domain = problems.attempt(top.get, "domain", None) or default_domain()
    where = "domain" if top.has("domain") else f"domain (from ${DOMAIN_ENV})"
    problems.check(
        resource_name_problem(f"{domain}/x") is None, f"{where}: {domain!r} is not a lowercase DNS subdomain"
    )
    policy = choice("allocationPolicy", "binpack", ALLOCATION_POLICIES)
    strategy = choice("deviceListStrategy", "envvar", DEVICE_LIST_STRATEGIES)
    cdi_kind = problems.attempt(top.get, "cdiKind", "nvidia.com/gpu") or "nvidia.com/gpu"
    problems.check(
        bool(_CDI_KIND.match(cdi_kind)), f"cdiKind: must be <vendor>/<class> such as nvidia.com/gpu, got {cdi_kind!r}"
    )
    device_specs = problems.attempt(top.get, "deviceSpecs", False) or False
    shared_product_suffix = problems.attempt(top.get, "sharedProductSuffix", False) or False
    deprecated_cuda_labels = problems.attempt(top.get, "deprecatedCudaLabels", False) or False
    device_root = problems.attempt(top.get, "deviceRoot", "/") or "/"
    problems.check(path_problem(device_root) is None, f"deviceRoot: {path_problem(device_root)}")
    mps_root = problems.attempt(top.get, "mpsRoot", DEFAULT_MPS_ROOT) or DEFAULT_MPS_ROOT
    problems.check(mps_root_problem(mps_root) is None, f"mpsRoot: {mps_root_problem(mps_root)}")

    watchdog = Fields(
        problems.attempt(top.get, "memoryWatchdog", {}) or {},
        "memoryWatchdog",
        {"policy": str, "quarantine": bool},
        problems.items,
    )
    given_policy = watchdog.get("policy", "report")
    watchdog.check(
        given_policy in WATCHDOG_POLICIES,
        "policy",
        f"must be one of {', '.join(WATCHDOG_POLICIES)}, got {given_policy!r}",
    )
    watchdog_policy = one_of(given_policy, WATCHDOG_POLICIES, "report")
    quarantine = watchdog.get("quarantine", False)

    raw_profiles: dict[str, tuple[str, Any]] = {}
    if top.has("pools"):
        raw_profiles[DEFAULT_PROFILE] = ("", problems.attempt(top.get, "pools"))
    raw = problems.attempt(top.get, "profiles", {}) or {}
    problems.check(len(raw) <= limits.MAX_PROFILES, f"profiles: at most {limits.MAX_PROFILES} profiles, got {len(raw)}")
    for name, body in list(raw.items())[: limits.MAX_PROFILES]:
        path = join("profiles", name)
        if name in raw_profiles:
            problems.items.append(f"{path}: profile {name!r} is already defined by the top-level pools")
            continue
        if not isinstance(name, str) or not POOL_NAME.match(name):
            problems.items.append(f"{path}: profile names must be {POOL_NAME_RULE}, got {safe_text(repr(name))}")
            continue
        body_fields = problems.attempt(Fields, body, path, {"pools": list})
        raw_profiles[name] = (path, body_fields and problems.attempt(body_fields.get, "pools", None, required=True))
    problems.check(bool(raw_profiles) or not isinstance(data, dict), "pools: is required (or profiles)")

    profiles = {}
    for name, (path, raw_pools) in raw_profiles.items():
        pools_path = join(path, "pools")
        if raw_pools is None:  # already reported
            continue
        problems.check(bool(raw_pools), f"{pools_path}: must list at least one pool")
        problems.check(
            len(raw_pools) <= limits.MAX_POOLS,
            f"{pools_path}: at most {limits.MAX_POOLS} pools per profile, got {len(raw_pools)}",
        )
        pools = [
            problems.attempt(_parse_pool, item, f"{pools_path}[{i}]", domain)
            for i, item in enumerate(raw_pools[: limits.MAX_POOLS])
        ]
        problems.items.extend(_cross_pool_problems(pools))
        profiles[name] = tuple(p for p in pools if p is not None)
    default = problems.attempt(top.get, "defaultProfile", DEFAULT_PROFILE) or DEFAULT_PROFILE
    problems.check(
        not raw_profiles or default in raw_profiles,
        f"defaultProfile: {default!r} is not a profile (profiles: {', '.join(sorted(raw_profiles))})",
    )
    if problems.items:
        raise ConfigError(problems.items, source)
    return Config(
        version=version,
        domain=domain,
        allocation_policy=policy,
        device_list_strategy=strategy,
        cdi_kind=cdi_kind,
        device_specs=device_specs,
        shared_product_suffix=shared_product_suffix,
        deprecated_cuda_labels=deprecated_cuda_labels,
        device_root=device_root,
        mps_root=mps_root,
        watchdog_policy=watchdog_policy,
        quarantine=quarantine,
        default_profile=default,
        profiles=profiles,
        source=source,
    )


def _parse_pool(item: Any, path: str, domain: str) -> PoolConfig:
    """One pool; every problem in it is raised together (one SchemaError per line)."""
    problems: list[str] = []
    fields = Fields(item, path, _POOL_KEYS, problems)
    name = fields.get("name", "", required=True)
    fields.check(not name or bool(POOL_NAME.match(name)), "name", f"must be {POOL_NAME_RULE}, got {name!r}")
    given_mode = fields.get("mode", "", required=True)
    fields.check(
        not given_mode or given_mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {given_mode!r}"
    )
    mode = one_of(given_mode, MODES, "shared")

    def only_for(key: str, allowed: bool, what: str) -> None:
        fields.check(allowed or not fields.has(key), key, f"only applies to {what} (this pool is {mode})")

    for owner, keys in MODE_KEYS.items():
        for key in keys:
            only_for(key, mode == owner, f"mode {owner}")
    strategy = fields.get("strategy", "mixed")
    fields.check(
        strategy in MIG_STRATEGIES, "strategy", f"must be one of {', '.join(MIG_STRATEGIES)}, got {strategy!r}"
    )
    dynamic = mode == "mig" and strategy == "dynamic"  # `replicas`: shares of each MIG instance made for claims
    fields.check(
        mode == "shared" or dynamic or not fields.has("replicas"),
        "replicas",
        f"only applies to mode shared, or mode mig with strategy dynamic (this pool is {mode}"
        + (f", strategy {safe_text(str(strategy), 20)})" if mode == "mig" else ")"),
    )

    if mode == "mig" and strategy == "mixed":
        fields.check(
            not fields.has("resource"),
            "resource",
            "not used by mode mig with strategy mixed: its resources are <domain>/mig-<profile>",
        )
        resource = ""
    else:
        resource = fields.get(
            "resource", DYNAMIC_MIG_RESOURCE if mode == "mig" and strategy == "dynamic" else DEFAULT_RESOURCE[mode]
        )
        if "/" not in resource:
            resource = f"{domain}/{resource}"
        problem = resource_name_problem(resource)
        fields.check(problem is None, "resource", f"{resource!r} is not a valid extended resource name: {problem}")

    backend = fields.get("backend", "timeSlicing")
    fields.check(backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    replicas, memory = 1, None
    if mode == "shared" or dynamic:
        fields.check(
            dynamic or not (fields.has("replicas") and fields.has("memoryPerShare")),
            "memoryPerShare",
            "give replicas or memoryPerShare, not both",
        )
        replicas = fields.get("replicas", DEFAULT_REPLICAS if mode == "shared" else 1)
        shown = safe_text(str(replicas), 40)
        fields.check(replicas >= 1, "replicas", f"must be >= 1, got {shown}")
        most, why = max_replicas(backend), f" for backend mps ({MPS_LIMIT_REASON})" if backend == "mps" else ""
        fields.check(replicas <= most, "replicas", f"must be <= {most}{why}, got {shown}")
        if mode == "shared" and fields.has("memoryPerShare"):
            try:
                memory = quantity_mib(fields.get("memoryPerShare", ""))
            except ValueError as err:
                problems.append(f"{join(path, 'memoryPerShare')}: {err}")
    fields.check(backend == "mps" or not fields.has("mpsLimits"), "mpsLimits", "only applies to backend mps")
    fields.check(
        backend == "mps" or not fields.has("exclusiveProcess"), "exclusiveProcess", "only applies to backend mps"
    )
    exclusive_process = fields.get("exclusiveProcess", False)
    mps_limits = fields.get("mpsLimits", "strict")
    fields.check(mps_limits in MPS_LIMITS, "mpsLimits", f"must be one of {', '.join(MPS_LIMITS)}, got {mps_limits!r}")
    strategies = _sharing_strategies(fields, backend, exclusive_process, path, problems)
    allow_span = fields.get("allowSpanGPUs", False)
    fields.check(
        not (allow_span and backend == "mps"),
        "allowSpanGPUs",
        "cannot be used with backend mps (one MPS server per GPU)",
    )
    selector = GpuSelector()
    if fields.has("gpus"):
        try:
            selector = _parse_selector(fields.get("gpus", None), join(path, "gpus"))
        except SchemaError as err:
            problems.append(str(err))
    if problems:
        raise PoolErrors(problems)
    return PoolConfig(
        name=name,
        mode=mode,
        resource=resource,
        domain=domain,
        replicas=replicas,
        memory_per_share_mib=memory,
        backend=one_of(backend, BACKENDS, "timeSlicing"),
        mps_limits=one_of(mps_limits, MPS_LIMITS, "strict"),
        allow_span=allow_span,
        exclusive_process=exclusive_process,
        sharing_strategies=strategies,
        mig_strategy=one_of(strategy, MIG_STRATEGIES, "mixed"),
        gpus=selector,
        key_path=path,
    )


def _sharing_strategies(
    fields: Fields, backend: str, exclusive_process: bool, path: str, problems: list[str]
) -> tuple[Backend, ...]:
    """`sharingStrategies`: what a DRA claim's SharingConfig may choose on an MPS pool (the backend alone when not
    given)."""
    if not fields.has("sharingStrategies"):
        return ()
    key = "sharingStrategies"
    given = fields.get(key, [])
    if backend != "mps":
        fields.check(
            False,
            key,
            "only applies to backend mps (a timeSlicing pool runs no MPS control daemon: "
            "its claims can only time-slice)",
        )
        return ()
    if not isinstance(fields.data[key], list):  # reported by get()
        return ()
    try:
        list_of(given, join(path, key), str, max_items=len(BACKENDS))
    except SchemaError as err:
        problems.append(str(err))
        return ()
    shown = safe_text(repr(given), 80)
    fields.check(all(s in BACKENDS for s in given), key, f"each must be one of {', '.join(BACKENDS)}, got {shown}")
    fields.check(len(set(given)) == len(given), key, f"lists a strategy twice: {shown}")
    fields.check("mps" in given, key, "must include mps, the pool's backend (a claim without a SharingConfig runs it)")
    fields.check(
        not (exclusive_process and "timeSlicing" in given),
        key,
        "timeSlicing cannot be offered with exclusiveProcess: true "
        "(EXCLUSIVE_PROCESS lets only the MPS server open a context on the GPU)",
    )
    return tuple(one_of(s, BACKENDS, "mps") for s in dict.fromkeys(given))


class PoolErrors(SchemaError):
    """Every problem of one pool."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("", "\n  ".join(problems))
        self.problems = problems


def _parse_selector(data: Any, path: str) -> GpuSelector:
    fields = Fields(data, path, {"indexes": list, "uuids": list, "models": list})
    most = limits.MAX_SELECTOR_ITEMS
    indexes = list_of(fields.get("indexes", []), join(path, "indexes"), int, most)
    for i, index in enumerate(indexes):
        if not 0 <= index <= limits.MAX_GPU_INDEX:
            raise SchemaError(
                f"{join(path, 'indexes')}[{i}]", f"must be 0-{limits.MAX_GPU_INDEX}, got {safe_text(str(index), 40)}"
            )
    selector = GpuSelector(
        indexes=tuple(indexes),
        uuids=tuple(list_of(fields.get("uuids", []), join(path, "uuids"), str, most)),
        models=tuple(list_of(fields.get("models", []), join(path, "models"), str, most)),
    )
    if selector.selects_rest:
        raise SchemaError(path, "selects no GPU: give indexes, uuids or models, or omit gpus to take the rest")
    return selector


def _cross_pool_problems(pools: list[PoolConfig | None]) -> list[str]:
    problems = []
    seen_names: dict[str, str] = {}
    seen_resources: dict[str, str] = {}
    rest_pool: str | None = None
    for pool in pools:
        if pool is None:
            continue
        if pool.name in seen_names:
            problems.append(f"{pool.key_path}.name: {pool.name!r} is already used by {seen_names[pool.name]}")
        seen_names.setdefault(pool.name, pool.key_path)
        if pool.resource and pool.resource in seen_resources:
            problems.append(
                f"{pool.key_path}.resource: {pool.resource!r} is already used by {seen_resources[pool.resource]}"
            )
        seen_resources.setdefault(pool.resource, pool.key_path)
        if pool.gpus.selects_rest:
            if rest_pool is not None:
                problems.append(
                    f"{pool.key_path}.gpus: only one pool may omit gpus ({rest_pool} already takes the rest)"
                )
            rest_pool = rest_pool or pool.key_path
    return problems
