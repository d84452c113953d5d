"""In CDI mode, check that the node's CDI specs name every device the plugin hands out.

Allocate returns `<cdiKind>=<UUID>` (a GPU or MIG UUID); the container runtime refuses a pod whose device has
no spec. Specs are YAML or JSON files in /etc/cdi and /var/run/cdi (the CDI spec's own directories); see
docs/configuration.md for generating one with UUID names.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.yamlfile import YamlProblem, decode, load_yaml, read_bounded

if TYPE_CHECKING:
    from ..config.types import Config
    from ..model.devices import Resource

log = logging.getLogger(__name__)

MAX_SPEC_BYTES = 4 * 1024 * 1024  # a spec for hundreds of devices is well under 1 MiB
MAX_SPEC_FILES = 256


def read_specs(dirs: tuple[str, ...]) -> tuple[frozenset[str], list[str]]:
    """Every `<kind>=<device name>` defined in the spec files of `dirs`, and one problem per file that cannot be
    read."""
    names: set[str] = set()
    problems: list[str] = []
    files: list[Path] = []
    for directory in (Path(d) for d in dirs if Path(d).is_dir()):
        try:
            files += (p for p in directory.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
        except OSError as err:
            problems.append(f"{directory}: cannot be listed: {err.strerror or err}")
    files.sort()
    if len(files) > MAX_SPEC_FILES:
        problems.append(f"{len(files)} CDI spec files, only the first {MAX_SPEC_FILES} are read")
    for path in files[:MAX_SPEC_FILES]:
        try:  # read_bounded names every cause: too large, not a regular file, a dangling link, no permission
            spec, _ = load_yaml(decode(read_bounded(path, MAX_SPEC_BYTES)))
        except YamlProblem as err:
            problems.append(f"{path}: cannot be read: {err}")
            continue
        if (
            not isinstance(spec, dict)
            or not isinstance(spec.get("kind"), str)
            or not isinstance(spec.get("devices", []), list)
        ):
            problems.append(f"{path}: not a CDI spec (needs `kind` and a `devices` list)")
            continue
        names.update(
            f"{spec['kind']}={d['name']}"
            for d in spec.get("devices", [])
            if isinstance(d, dict) and isinstance(d.get("name"), str)
        )
    return frozenset(names), problems


def check_specs(resources: list[Resource], kind: str, dirs: tuple[str, ...]) -> dict[str, list[str]]:
    """Per resource, its `<kind>=<UUID>` names that no spec defines; logs one warning per resource lacking some."""
    defined, problems = read_specs(dirs)
    for problem in problems:
        log.warning("CDI spec %s", problem)
    if not any(Path(d).is_dir() for d in dirs):
        log.warning("no CDI spec directory (%s) exists: every device would be refused by the runtime", ", ".join(dirs))
    missing_by_resource = {}
    for resource in resources:
        wanted = sorted({f"{kind}={unit.uuid}" for unit in resource.units})
        missing = [name for name in wanted if name not in defined]
        missing_by_resource[resource.name] = missing
        if missing:
            log.warning(
                "%s: %d of %d CDI devices are in no spec under %s: %s (generate one: nvidia-ctk cdi generate "
                "--device-name-strategy=uuid)",
                resource.name,
                len(missing),
                len(wanted),
                ", ".join(dirs),
                ", ".join(missing),
            )
    return missing_by_resource


class CdiCheck:
    """`missing`: in CDI mode, per resource, its devices that no spec in `dirs` names (logged); follows config
    reloads."""

    def __init__(self, dirs: tuple[str, ...]) -> None:
        self.dirs = dirs
        self.missing: dict[str, list[str]] = {}

    def on_config(self, config: Config, resources: list[Resource]) -> None:
        """Check the devices of `resources` (at start-up and after each config reload)."""
        self.missing = (
            check_specs(resources, config.cdi_kind, self.dirs) if config.device_list_strategy == "cdi" else {}
        )
